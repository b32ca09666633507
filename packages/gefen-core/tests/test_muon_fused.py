"""GefenMuon's ``fused`` option: the Triton Muon momentum kernel (docs/algorithm.md#gefenmuon) on
CUDA, the PyTorch reference elsewhere, and the same refusal as Gefen when ``fused=True`` cannot be
honoured."""

from __future__ import annotations

import importlib

import pytest
import torch

from gefen_core import Gefen
from gefen_core.muon import GefenMuon

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _named(device: str, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"attn.weight": (96, 64), "mlp.weight": (256, 384), "odd.weight": (7, 4099)}
    return [(n, torch.randn(s, generator=gen).to(device, dtype).requires_grad_())
            for n, s in shapes.items()]


def _feed(params: list[tuple[str, torch.Tensor]], step: int) -> None:
    """Gradients that depend only on the step, so both optimizers see the same ones."""
    gen = torch.Generator().manual_seed(100 + step)
    for _, p in params:
        g = torch.randn(p.shape, generator=gen) * (0.5 + step % 3)
        p.grad = g.to(p.device, p.dtype)


# ------------------------------------------------------------------ CPU: the refusal


def test_fused_true_on_cpu_raises_the_error_gefen_raises() -> None:
    w = torch.nn.Parameter(torch.randn(4, 6))
    with pytest.raises(RuntimeError) as muon_err:
        GefenMuon([("w", w)], fused=True)
    with pytest.raises(RuntimeError) as gefen_err:
        Gefen([("w", w)], fused=True)
    assert str(muon_err.value) == str(gefen_err.value)
    assert "fused=True cannot be honoured for parameter 'w'" in str(muon_err.value)
    assert "CUDA" in str(muon_err.value) and "fused=None" in str(muon_err.value)


def test_fused_true_group_on_cpu_is_refused_before_registration() -> None:
    opt = GefenMuon([("a", torch.nn.Parameter(torch.randn(4, 4)))])
    with pytest.raises(RuntimeError, match="fused=True cannot be honoured for parameter 'b'"):
        opt.add_param_group({"params": [("b", torch.nn.Parameter(torch.randn(3, 5)))],
                             "fused": True})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("fused", [None, False])
def test_cpu_matrices_take_the_reference(fused: bool | None) -> None:
    params = _named("cpu")
    opt = GefenMuon(params, lr=0.02, fused=fused)
    assert opt.step_paths() == {n: "for_loop" for n, _ in params}
    _feed(params, 1)
    opt.step()
    assert all(torch.isfinite(p).all() for _, p in params)


# ------------------------------------------------------------------ CUDA: the kernel


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_none_and_true_pick_the_kernel_on_cuda(dtype: torch.dtype,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import gefen_kernels

    # The module; ``gefen_kernels.ops.muon_momentum`` the attribute is the op's function.
    op_module = importlib.import_module("gefen_kernels.ops.muon_momentum")

    if not gefen_kernels.triton_available():
        pytest.fail("CUDA is present but Triton is not: the fused path cannot be tested")
    launches: list[tuple[int, ...]] = []
    real = op_module.launch_muon_momentum

    def counting(grad, *args, **kwargs):
        launches.append(tuple(grad.shape))
        return real(grad, *args, **kwargs)

    monkeypatch.setattr(op_module, "launch_muon_momentum", counting)
    for fused, path in ((None, "fused"), (True, "fused"), (False, "for_loop")):
        params = _named("cuda", dtype)
        opt = GefenMuon(params, lr=0.02, fused=fused)
        assert opt.step_paths() == {n: path for n, _ in params}
        launches.clear()
        for step in (1, 2):
            _feed(params, step)
            opt.step()
        assert len(launches) == (2 * len(params) if path == "fused" else 0)
    fp64 = [("w", torch.nn.Parameter(torch.randn(8, 8, device="cuda", dtype=torch.float64)))]
    assert GefenMuon(fp64).step_paths() == {"w": "for_loop"}
    with pytest.raises(RuntimeError, match="fused=True cannot be honoured for parameter 'w'"):
        GefenMuon(fp64, fused=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("options", [
    {"nesterov": True},
    {"nesterov": False, "maximize": True},
    {"nesterov": True, "stochastic_round": True},
    {"nesterov": True, "stochastic_round": True, "capturable": True},
])
def test_fused_equals_reference_path_over_several_steps(dtype: torch.dtype,
                                                        options: dict) -> None:
    """fused=True vs fused=False on CUDA: identical codes, scales and parameters.

    The bound is zero, derived as follows. The kernel's codes, scales and dense momentum equal
    the reference's bit for bit (gefen-kernels ``test_muon_momentum_triton.py``: the only
    reduction is an order-independent max). Everything after the momentum (Newton–Schulz,
    NorMuon/cautious when enabled, decay and the update) is the same torch code on the same
    device and stream with identical inputs, and cuBLAS/cuda kernels are run-to-run
    reproducible under those conditions. The gradients depend only on the step number, so
    a mismatch cannot be amplified by a different training trajectory: any difference is a
    kernel/reference disagreement, caught first on the codes and scales.
    """
    fused_params = _named("cuda", dtype)
    ref_params = [(n, p.detach().clone().requires_grad_()) for n, p in fused_params]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, **options)
    fused = GefenMuon(fused_params, fused=True, **kw)
    ref = GefenMuon(ref_params, fused=False, **kw)
    assert set(fused.step_paths().values()) == {"fused"}
    assert set(ref.step_paths().values()) == {"for_loop"}
    for step in range(1, 6):
        _feed(fused_params, step)
        _feed(ref_params, step)
        fused.step()
        ref.step()
        for (name, a), (_, b) in zip(fused_params, ref_params, strict=True):
            sa, sb = fused.state[a], ref.state[b]
            assert sa["period"] == sb["period"], name
            assert torch.equal(sa["exp_avg_codes"], sb["exp_avg_codes"]), (name, step)
            assert torch.equal(sa["exp_avg_scale"], sb["exp_avg_scale"]), (name, step)
            assert torch.equal(a, b), (name, step)
    for _, p in fused_params:
        assert torch.isfinite(p).all()
