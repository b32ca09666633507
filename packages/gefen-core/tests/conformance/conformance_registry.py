"""The optimizers the torch.optim conformance suite checks, and the helpers its checks share.

Each :class:`ConformanceInfo` says how to build one optimizer configuration over a small
model of its own (the parameters it is meant for: GefenMuon gets matrices only, the hybrid a
model with an embedding, matrices and norms) and which ``torch.optim`` class it stands in for.
Every check in this directory runs over :data:`INFOS` and :data:`DEVICES`; a new optimizer or
mode gets the whole suite by adding an entry. The contracts are torch.optim's documented
behaviour; where Gefen differs on purpose, docs/internals/torch-optim-deviations.md says so
and the error checks assert the difference.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gefen_core import Gefen, GefenMuon, GefenMuonHybrid

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


class _Mlp(nn.Module):
    """1-D and 2-D parameters (Gefen's block and factored paths, its period gates)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


class _Matrices(nn.Module):
    """Weight matrices only: what GefenMuon (and torch.optim.Muon) trains."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16, bias=False)
        self.fc2 = nn.Linear(16, 4, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class _Lm(nn.Module):
    """An embedding, hidden matrices and a norm: both halves of the hybrid get parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: Tensor) -> Tensor:
        idx = (x.abs() * 7).long().clamp_max(11)[:, 0]
        return self.fc2(torch.tanh(self.norm(self.fc1(self.embed(idx)))))


@dataclass(frozen=True)
class ConformanceInfo:
    """One optimizer configuration under the conformance checks.

    Attributes:
        id: test id.
        optim_cls: the class.
        model_cls: the model whose parameters it trains.
        kwargs: constructor options of this configuration.
        reference_cls: the ``torch.optim`` class it replaces (``None`` when torch has none, or
            when this torch build lacks it: ``torch.optim.Muon`` is newer than the floor).
        named_only: the class routes by name and always takes ``(name, tensor)`` pairs.
        accepts_betas: the constructor takes ``betas`` (for the tensor-betas check).
    """

    id: str
    optim_cls: type[torch.optim.Optimizer]
    model_cls: type[nn.Module]
    kwargs: dict[str, Any] = field(default_factory=dict)
    reference_cls: type[torch.optim.Optimizer] | None = None
    named_only: bool = False
    accepts_betas: bool = True

    def model(self, device: str) -> nn.Module:
        torch.manual_seed(0)
        return self.model_cls().to(device)

    def build(
        self,
        model_or_params: Any,
        *,
        named: bool = True,
        **overrides: Any,
    ) -> torch.optim.Optimizer:
        """The optimizer over ``model_or_params`` (a model: its parameters, named or not)."""
        params = model_or_params
        if isinstance(params, nn.Module):
            params = (
                list(params.named_parameters())
                if named or self.named_only
                else list(params.parameters())
            )
        options = {"lr": 1e-2, **copy.deepcopy(self.kwargs), **overrides}
        return self.optim_cls(params, **options)


INFOS = [
    ConformanceInfo(
        "Gefen-block", Gefen, _Mlp, {"factored_v_2d": False}, reference_cls=torch.optim.AdamW
    ),
    ConformanceInfo(
        "Gefen-factored", Gefen, _Mlp, {"factored_v_2d": True}, reference_cls=torch.optim.AdamW
    ),
    ConformanceInfo(
        "GefenMuon",
        GefenMuon,
        _Matrices,
        reference_cls=getattr(torch.optim, "Muon", None),
        accepts_betas=False,
    ),
    ConformanceInfo(
        "GefenMuonHybrid-gefen",
        GefenMuonHybrid,
        _Lm,
        {"backup_optimizer": "gefen"},
        named_only=True,
    ),
    ConformanceInfo(
        "GefenMuonHybrid-adamw",
        GefenMuonHybrid,
        _Lm,
        {"backup_optimizer": "adamw"},
        named_only=True,
    ),
]
INFO_PARAMS = [pytest.param(info, id=info.id) for info in INFOS]


def feed(model: nn.Module, step: int) -> None:
    """Seeded gradients for every parameter (the same for the same step on any run)."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: range,
    before_step: Callable[[int], None] | None = None,
) -> None:
    for step in steps:
        feed(model, step)
        if before_step is not None:
            before_step(step)
        opt.step()


def batch(device: str) -> Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(7)).to(device)


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key in sorted(value, key=repr):
            yield from _leaves(value[key], f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def assert_same_state_dict(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two state dicts hold the same keys, values and tensors (bit for bit, same dtype)."""
    left, right = list(_leaves(a, "sd")), list(_leaves(b, "sd"))
    assert [p for p, _ in left] == [p for p, _ in right]
    for (path, x), (_, y) in zip(left, right):
        if isinstance(x, Tensor):
            assert isinstance(y, Tensor) and x.dtype == y.dtype, path
            assert torch.equal(x.cpu(), y.cpu()), path
        else:
            assert x == y, path
