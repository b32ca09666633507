"""gefen_core.warm_up: the kernels of a model's first and steady steps run ahead of a job, on
throwaway tensors; the model is left exactly as it was."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from gefen_core import Gefen, step_in_backward, warm_up


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 32), nn.Linear(32, 64), nn.LayerNorm(64),
                         nn.Linear(64, 16))


def _snapshot(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    return [(p.detach().clone(), None if p.grad is None else p.grad.clone())
            for p in model.parameters()]


@pytest.mark.parametrize("in_backward", [False, True])
def test_warm_up_leaves_the_model_as_it_was(in_backward: bool) -> None:
    model = _model()
    model[1].weight.grad = torch.ones_like(model[1].weight)  # a gradient the call must keep
    before = _snapshot(model)
    seconds = warm_up(model, in_backward=in_backward, min_dim_size_to_factor=8)
    assert seconds > 0
    for p, (value, grad) in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, value)
        assert (p.grad is None) == (grad is None) and (grad is None or torch.equal(p.grad, grad))
    # No hook was left on the model: a backward leaves every gradient in place.
    model.zero_grad(set_to_none=True)
    model[3](model[2](model[1](model[0](torch.tensor([[1, 2]]))))).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_warm_up_runs_the_steps_a_job_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two optimizer steps (the first and a steady one), each with a gradient for every copy,
    with the options given; in backward, through step_in_backward's hooks."""
    calls: list[tuple[int, bool, int]] = []
    real_step = Gefen.step

    def spy(self, closure=None):  # type: ignore[no-untyped-def]
        grads = sum(p.grad is not None for g in self.param_groups for p in g["params"])
        calls.append((len(self.state), self.param_groups[0]["stochastic_round"], grads))
        return real_step(self, closure)

    monkeypatch.setattr(Gefen, "step", spy)
    model = _model()
    n = len(list(model.parameters()))
    warm_up(model.named_parameters(), stochastic_round=True)
    assert calls == [(0, True, n), (n, True, n)]
    calls.clear()
    hooked = []
    real_hooks = step_in_backward

    def spy_hooks(params, opt, **kw):  # type: ignore[no-untyped-def]
        handle = real_hooks(params, opt, **kw)
        hooked.append(handle)
        return handle

    # The module, not the function that shares its name in the package's namespace.
    monkeypatch.setattr(importlib.import_module("gefen_core.warm_up"), "step_in_backward",
                        spy_hooks)
    warm_up(list(model.parameters()), in_backward=True)
    assert len(hooked) == 1 and len(calls) == 2
    # The first step keeps every gradient (a full step); on the second the hooks stepped every
    # tensor but the one kept for opt.step() (the smallest of the group).
    assert calls[0][2] == n and calls[1][2] == 1


@pytest.mark.parametrize("bad", [[], nn.Linear(2, 2).requires_grad_(False), [1.0]])
def test_warm_up_refuses_params_without_tensors(bad: object) -> None:
    with pytest.raises(ValueError, match="params must be"):
        warm_up(bad)  # type: ignore[arg-type]


def test_warm_up_passes_gefens_own_errors() -> None:
    with pytest.raises(ValueError, match="Invalid learning rate"):
        warm_up(_model(), lr=-1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("in_backward", [False, True])
def test_warm_up_on_cuda_bf16_leaves_the_model_as_it_was(in_backward: bool) -> None:
    model = _model().to("cuda", torch.bfloat16)
    before = _snapshot(model)
    warm_up(model, in_backward=in_backward, min_dim_size_to_factor=8)
    for p, (value, grad) in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, value) and p.grad is None and grad is None
