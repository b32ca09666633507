"""Mixed precision (docs/algorithm.md#mixed-precision): the native GradScaler protocol and overflow
steps."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gefen_core import Gefen


def _snapshot(model: nn.Module, opt: Gefen) -> dict:
    return copy.deepcopy({
        "params": [p.detach() for p in model.parameters()],
        "state": [dict(opt.state[p]) for p in model.parameters()],
        "T": opt._global_step,
        "codebook": opt._codebook,
    })


def _equal(a: dict, b: dict) -> None:
    assert a["T"] == b["T"]
    assert (a["codebook"] is None and b["codebook"] is None) or torch.equal(
        a["codebook"], b["codebook"])
    for x, y in zip(a["params"], b["params"]):
        assert x.dtype == y.dtype and torch.equal(x, y)
    for sa, sb in zip(a["state"], b["state"]):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), k


def _fp16_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).half()


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(32, 8, generator=gen).half()
    y = torch.randn(32, 1, generator=gen).half()
    return ((model(x).float() - y.float()) ** 2).mean()


@pytest.mark.parametrize("first_step_overflows", [True, False])
def test_grad_scaler_overflow_mutates_nothing(first_step_overflows: bool) -> None:
    model = _fp16_model()
    opt = Gefen(model.parameters(), lr=1e-2)
    assert opt._step_supports_amp_scaling  # fp16 parameters: the native protocol
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    steps = 0 if first_step_overflows else 2
    for step in range(steps):
        scaler.scale(_loss(model, step)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    before = _snapshot(model, opt)
    scaler.scale(_loss(model, 10) * 1e6).backward()  # fp16 gradients overflow
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters())
    scale_before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    _equal(before, _snapshot(model, opt))
    assert scaler.get_scale() < scale_before  # the scaler saw the overflow
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")


def test_grad_scaler_unscales_exactly_like_manual_unscaling() -> None:
    scaled_model = _fp16_model()
    plain_model = copy.deepcopy(scaled_model)
    scaled = Gefen(scaled_model.parameters(), lr=1e-2)
    plain = Gefen(plain_model.parameters(), lr=1e-2)
    scale = 2.0 ** 8
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000)
    for step in range(3):
        scaler.scale(_loss(scaled_model, step)).backward()
        scaler.step(scaled)
        scaler.update()
        scaled.zero_grad()
        # The same gradients, scaled then unscaled by hand in fp16 (each tensor rounds once).
        (_loss(plain_model, step) * scale).backward()
        for p in plain_model.parameters():
            p.grad.mul_(float(torch.tensor(1.0 / scale, dtype=torch.float32)))
        plain.step()
        plain.zero_grad()
    for a, b in zip(scaled_model.parameters(), plain_model.parameters()):
        assert torch.equal(a, b)
    assert scaled._global_step == 3


def test_protocol_attributes_set_by_hand() -> None:
    w = torch.randn(8, 4, requires_grad=True)
    opt = Gefen([w], lr=1e-2)
    w.grad = torch.randn(8, 4)
    opt.found_inf = torch.ones(1)
    opt.grad_scale = torch.tensor(4.0)
    before = (w.detach().clone(), opt._global_step)
    opt.step()
    assert torch.equal(w.detach(), before[0]) and opt._global_step == 0 and opt._codebook is None
    assert not opt.state[w]

    ref_w = w.detach().clone().requires_grad_()
    ref = Gefen([ref_w], lr=1e-2)
    g = torch.randn(8, 4)
    ref_w.grad = g.clone()
    ref.step()
    opt.found_inf = torch.zeros(1)
    opt.grad_scale = torch.tensor(4.0)
    w.grad = g * 4
    opt.step()
    assert torch.equal(w.detach(), ref_w.detach())
    assert torch.equal(w.grad, g)  # unscaled in place

    for bad, match in ((torch.ones(2), "1-element"), (torch.tensor(0.0), "finite and > 0"),
                       (torch.tensor(float("inf")), "finite and > 0")):
        opt.found_inf = torch.zeros(1)
        opt.grad_scale = bad
        with pytest.raises(RuntimeError, match=match):
            opt.step()
