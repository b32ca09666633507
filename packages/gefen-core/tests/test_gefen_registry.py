"""Generic checks driven by the ``gefen_core.testing`` registry."""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch
from torch import nn

from gefen_core.testing import OptimizerInfo, optim_db

CASES = [(info, inp) for info in optim_db for inp in info.optim_inputs_func("cpu")]
IDS = [f"{info.optim_cls.__name__}-{inp.desc}" for info, inp in CASES]
# Inputs that do not fix the implementation themselves can be run with foreach on and off.
PARITY = [(info, inp) for info, inp in CASES
          if "foreach" in info.supported_impls and "foreach" not in inp.kwargs]
PARITY_IDS = [f"{info.optim_cls.__name__}-{inp.desc}" for info, inp in PARITY]
WITH_REFERENCE = [info for info in optim_db if info.reference_cls is not None]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 3))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("info", WITH_REFERENCE, ids=lambda i: i.optim_cls.__name__)
def test_defaults_equal_reference(info: OptimizerInfo) -> None:
    assert info.reference_cls is not None
    ours = inspect.signature(info.optim_cls).parameters
    for name, ref in inspect.signature(info.reference_cls).parameters.items():
        assert ours[name].default == ref.default, name


@pytest.mark.parametrize("info,inp", CASES, ids=IDS)
def test_state_dict_round_trip_then_continue(info: OptimizerInfo, inp) -> None:  # noqa: ANN001
    model = _model()
    opt = info.optim_cls(model.parameters(), **copy.deepcopy(inp.kwargs))
    _steps(model, opt, range(3))
    saved = copy.deepcopy(model.state_dict())
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    _steps(model, opt, range(3, 5))

    resumed = _model()
    resumed.load_state_dict(saved)
    opt2 = info.optim_cls(resumed.parameters(), **copy.deepcopy(inp.kwargs))
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    _steps(resumed, opt2, range(3, 5))
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("info,inp", PARITY, ids=PARITY_IDS)
def test_foreach_matches_for_loop(info: OptimizerInfo, inp) -> None:  # noqa: ANN001
    results = []
    for foreach in (False, True):
        model = _model()
        opt = info.optim_cls(model.parameters(), foreach=foreach, **copy.deepcopy(inp.kwargs))
        assert set(opt.step_paths().values()) == {"foreach" if foreach else "for_loop"}
        _steps(model, opt, range(3))
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
