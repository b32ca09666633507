"""Invalid input raises what ``torch.optim`` raises for the same mistake: the same exception
type, a message that starts with torch's own text.

Every case is also run against the ``torch.optim`` class the optimizer replaces (AdamW for
Gefen; Muon for GefenMuon where this torch has it), so the table is checked against torch's
actual behaviour rather than copied from it. The deliberate differences of
docs/internals/torch-optim-deviations.md are cases of their own: there the test asserts both
sides of the difference, so a change on either side shows up.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conformance_registry import DEVICES, INFOS, ConformanceInfo
from torch import nn

from gefen_core import GefenMuonHybrid

Params = Callable[[str], Any]


def _matrix(device: str) -> nn.Parameter:
    return nn.Parameter(torch.randn(4, 3, device=device))


def _pair(device: str) -> list[nn.Parameter]:
    return [_matrix(device), nn.Parameter(torch.randn(3, 2, device=device))]


@dataclass(frozen=True)
class Case:
    """One input and how both sides must answer it.

    ``error``/``regex``: what the Gefen-family class raises (at construction, or at the first
    step when ``at_step``). ``torch``: what the reference class does with the same input:
    ``"same"`` (raises ``error`` matching ``regex``), ``"accepts"`` (constructs and steps:
    Gefen refuses on purpose), ``"refuses"`` (raises something: Gefen accepts on purpose), or
    ``None`` (no comparison: torch fails on it by accident, see the deviations doc).
    """

    desc: str
    kwargs: dict[str, Any]
    error: type[BaseException] | None
    regex: str = ""
    params: Params = _pair
    torch: str | None = "same"
    at_step: bool = False


def _sparse_grad(device: str) -> list[nn.Parameter]:
    p = _matrix(device)
    p.grad = torch.zeros(4, 3, device=device).to_sparse()
    return [p]


def _complex(device: str) -> list[nn.Parameter]:
    p = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64, device=device))
    p.grad = torch.randn_like(p)
    return [p]


def _twice(device: str) -> list[nn.Parameter]:
    p = _matrix(device)
    return [p, p]


def _in_two_groups(device: str) -> list[dict[str, Any]]:
    p = _matrix(device)
    return [{"params": [p]}, {"params": [p]}]


ADAMW_CASES = [
    Case("negative lr", {"lr": -1e-3}, ValueError, r"^Invalid learning rate: -0\.001"),
    Case("nan lr", {"lr": float("nan")}, ValueError, r"^Invalid learning rate: nan"),
    Case(
        "2-element tensor lr",
        {"lr": torch.tensor([1e-3, 1e-3])},
        ValueError,
        r"^Tensor lr must be 1-element",
    ),
    Case("negative eps", {"eps": -1e-8}, ValueError, r"^Invalid epsilon value: -1e-08"),
    Case(
        "beta1 = 1",
        {"betas": (1.0, 0.999)},
        ValueError,
        r"^Invalid beta parameter at index 0: 1\.0",
    ),
    Case(
        "negative beta2",
        {"betas": (0.9, -0.1)},
        ValueError,
        r"^Invalid beta parameter at index 1: -0\.1",
    ),
    Case(
        "tensor beta1 = 1",
        {"betas": (torch.tensor(1.0), torch.tensor(0.999))},
        ValueError,
        r"^Invalid beta parameter at index 0: 1\.0",
    ),
    Case(
        "float and tensor betas",
        {"betas": (0.9, torch.tensor(0.99))},
        ValueError,
        r"^betas must be either both floats or both Tensors",
    ),
    Case(
        "tensor and float betas",
        {"betas": (torch.tensor(0.9), 0.99)},
        ValueError,
        r"^betas must be either both floats or both Tensors",
    ),
    Case(
        "negative weight_decay",
        {"weight_decay": -1},
        ValueError,
        r"^Invalid weight_decay value: -1",
    ),
    Case(
        "fused and foreach",
        {"fused": True, "foreach": True},
        RuntimeError,
        r"^`fused` and `foreach` cannot be `True` together\.",
    ),
    Case(
        "fused and differentiable",
        {"fused": True, "differentiable": True},
        RuntimeError,
        r"^`fused` does not support `differentiable`",
    ),
    Case(
        "empty params",
        {},
        ValueError,
        r"^optimizer got an empty parameter list",
        params=lambda d: [],
    ),
    Case(
        "non-tensor param",
        {},
        TypeError,
        r"^optimizer can only optimize Tensors, but one of the params is float",
        params=lambda d: [1.0],
    ),
    Case(
        "non-leaf param",
        {},
        ValueError,
        r"^can't optimize a non-leaf Tensor",
        params=lambda d: [torch.randn(3, 2, device=d, requires_grad=True) * 2],
    ),
    Case(
        "param in two groups",
        {},
        ValueError,
        r"^some parameters appear in more than one parameter group",
        params=_in_two_groups,
    ),
    Case(
        "set of params",
        {},
        TypeError,
        r"^optimizer parameters need to be organized in ordered collections",
        params=lambda d: [{"params": {_matrix(d)}}],
    ),
    Case(
        "group not a dict",
        {},
        TypeError,
        r"^param_group must be a dict, but got",
        params=lambda d: [{"params": [_matrix(d)]}, [_matrix(d)]],
    ),
    Case(
        "sparse gradient",
        {},
        RuntimeError,
        r"does not support sparse gradients, please consider SparseAdam instead",
        params=_sparse_grad,
        at_step=True,
    ),
    # Gefen refuses on purpose (docs/internals/torch-optim-deviations.md).
    Case("zero eps", {"eps": 0.0}, ValueError, r"^Invalid epsilon value: 0\.0", torch="accepts"),
    Case(
        "infinite lr",
        {"lr": float("inf")},
        ValueError,
        r"^Invalid learning rate: inf",
        torch="accepts",
    ),
    Case(
        "infinite weight_decay",
        {"weight_decay": float("inf")},
        ValueError,
        r"^Invalid weight_decay value: inf",
        torch="accepts",
    ),
    Case("amsgrad", {"amsgrad": True}, RuntimeError, r"amsgrad=True", torch="accepts"),
    Case(
        "differentiable",
        {"differentiable": True},
        RuntimeError,
        r"differentiable=True",
        torch="accepts",
    ),
    Case("complex param", {}, ValueError, r"is complex", params=_complex, torch="accepts"),
    Case(
        "param twice in a group",
        {},
        ValueError,
        r"appears twice in this group",
        params=_twice,
        torch="accepts",
    ),
    Case(
        "multi-element tensor beta",
        {"betas": (torch.tensor([0.9, 0.9]), torch.tensor(0.99))},
        ValueError,
        r"^Tensor betas\[0\] must be 1-element",
        torch=None,
    ),
    Case(
        "group without params",
        {},
        ValueError,
        r"needs a 'params' entry",
        params=lambda d: [{"lr": 1.0}],
        torch=None,
    ),
    # Gefen accepts on purpose.
    Case("a bare tensor", {}, None, params=lambda d: _matrix(d), torch="refuses"),
    Case(
        "named and unnamed params",
        {},
        None,
        params=lambda d: [("w", _matrix(d)), _matrix(d)],
        torch="refuses",
    ),
    Case(
        "groups with and without names",
        {},
        None,
        params=lambda d: [{"params": [_matrix(d)]}, {"params": [("w", _matrix(d))]}],
        torch="refuses",
    ),
    Case(
        "tensor lr with foreach", {"lr": torch.tensor(1e-3), "foreach": True}, None, torch="refuses"
    ),
    Case(
        "tensor betas with foreach",
        {"betas": (torch.tensor(0.9), torch.tensor(0.99)), "foreach": True},
        None,
        torch="refuses",
    ),
    Case("int betas", {"betas": (0, 0.99)}, None, torch="refuses"),
]

MUON_CASES = [
    Case("negative lr", {"lr": -1.0}, ValueError, r"^Learning rate should be >= 0 but is: -1\.0"),
    Case(
        "2-element tensor lr",
        {"lr": torch.tensor([1e-3, 1e-3])},
        ValueError,
        r"^Tensor lr must be 1-element",
    ),
    Case(
        "negative momentum",
        {"momentum": -0.1},
        ValueError,
        r"^momentum should be >= 0 but is: -0\.1",
    ),
    Case(
        "negative weight_decay",
        {"weight_decay": -0.1},
        ValueError,
        r"^weight decay should be >= 0 but is: -0\.1",
    ),
    Case(
        "unknown adjust_lr_fn",
        {"adjust_lr_fn": "arbitrary"},
        ValueError,
        r"^Adjust learning rate function arbitrary is not supported",
    ),
    Case(
        "3-D param",
        {},
        ValueError,
        r"^Muon only supports 2D parameters whereas we found a parameter with size: "
        r"torch\.Size\(\[2, 3, 4\]\)",
        params=lambda d: [nn.Parameter(torch.randn(2, 3, 4, device=d))],
    ),
    Case(
        "sparse gradient",
        {},
        RuntimeError,
        r"Muon does not support sparse gradients",
        params=_sparse_grad,
        at_step=True,
    ),
    # GefenMuon refuses on purpose: its codes are a fraction of the momentum in [0, 1).
    Case(
        "momentum 1",
        {"momentum": 1.0},
        ValueError,
        r"momentum must be a float in \[0, 1\)",
        torch="accepts",
    ),
]

HYBRID_CASES = [
    Case(
        "negative lr",
        {"lr": -1.0},
        ValueError,
        r"^Learning rate should be >= 0 but is: -1\.0",
        torch=None,
    ),
    Case(
        "beta1 = 1",
        {"betas": (1.0, 0.999)},
        ValueError,
        r"^Invalid beta parameter at index 0: 1\.0",
        torch=None,
    ),
    Case(
        "float and tensor betas",
        {"betas": (0.9, torch.tensor(0.99))},
        ValueError,
        r"^betas must be either both floats or both Tensors",
        torch=None,
    ),
    Case("negative eps", {"eps": -1.0}, ValueError, r"^Invalid epsilon value: -1\.0", torch=None),
    Case(
        "unknown backup", {"backup_optimizer": "sgd"}, ValueError, r"backup_optimizer", torch=None
    ),
]


def _hybrid_params(device: str) -> list[tuple[str, nn.Parameter]]:
    return [("fc.weight", _matrix(device)), ("norm.weight", nn.Parameter(torch.ones(3)))]


def _cases() -> list[Any]:
    out = []
    for info in INFOS:
        if info.optim_cls is GefenMuonHybrid:
            table = [
                Case(c.desc, c.kwargs, c.error, c.regex, _hybrid_params, None) for c in HYBRID_CASES
            ]
        elif info.accepts_betas:
            table = ADAMW_CASES
        else:
            table = MUON_CASES
        for case in table:
            for device in DEVICES:
                out.append(
                    pytest.param(
                        info,
                        case,
                        device.values[0],
                        marks=device.marks,
                        id=f"{info.id}-{case.desc}-{device.id}",
                    )
                )
    return out


def _construct_and_step(
    cls: type[torch.optim.Optimizer], params: Any, kwargs: dict[str, Any], at_step: bool
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns on some accepted inputs (duplicates)
        opt = cls(params, **kwargs)
        if at_step:
            opt.step()


def _build(info: ConformanceInfo, case: Case, device: str) -> Any:
    kwargs = {**info.kwargs, **case.kwargs}
    if info.optim_cls is GefenMuonHybrid:
        kwargs.setdefault("lr", 1e-3)
    return case.params(device), kwargs


@pytest.mark.parametrize(("info", "case", "device"), _cases())
def test_invalid_input_raises_torchs_error(info: ConformanceInfo, case: Case, device: str) -> None:
    params, kwargs = _build(info, case, device)
    if case.error is None:
        _construct_and_step(info.optim_cls, params, kwargs, case.at_step)
    else:
        with pytest.raises(case.error, match=case.regex):
            _construct_and_step(info.optim_cls, params, kwargs, case.at_step)

    reference = info.reference_cls
    if reference is None or case.torch is None:
        return
    params, _ = _build(info, case, device)
    ref_kwargs = dict(case.kwargs)
    if case.torch == "accepts":
        _construct_and_step(reference, params, ref_kwargs, case.at_step)
    elif case.torch == "refuses":
        with pytest.raises((TypeError, ValueError, RuntimeError)):
            _construct_and_step(reference, params, ref_kwargs, case.at_step)
    else:
        assert case.error is not None
        # torch's own message, without the guidance Gefen appends after it.
        with pytest.raises(case.error, match=re.compile(case.regex)):
            _construct_and_step(reference, params, ref_kwargs, case.at_step)
