"""torch.optim's stepping contracts for every Gefen-family optimizer (conformance_registry).

* ``copy.deepcopy`` and pickling after training give an independent optimizer that steps
  exactly as the original;
* zero-size parameters train and checkpoint beside the others;
* ``step(closure)`` runs the closure with gradients enabled and returns its loss;
* LR schedulers (StepLR, LambdaLR, MultiplicativeLR, ExponentialLR, CosineAnnealingLR,
  OneCycleLR's lr, ReduceLROnPlateau) drive the lr the step uses, float or tensor lr;
* a tensor ``lr`` steps as the same float and follows in-place changes;
* ``betas`` given as tensors (as ``torch.optim.AdamW`` takes them) step as the same floats and
  follow in-place changes.
"""

from __future__ import annotations

import copy
import pickle
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conformance_registry import (
    DEVICES,
    INFO_PARAMS,
    INFOS,
    ConformanceInfo,
    assert_same_params,
    assert_same_state_dict,
    batch,
    feed,
    train,
)
from torch import nn
from torch.optim import lr_scheduler

WITH_BETAS = [pytest.param(i, id=i.id) for i in INFOS if i.accepts_betas]
CLONES: dict[str, Callable[[Any], Any]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
}
# lr = 2**-6 is exact in fp32, so a tensor lr and the float give the same bits.
LR = 2.0**-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", sorted(CLONES))
@pytest.mark.parametrize("info", INFO_PARAMS)
def test_copy_after_training_is_independent_and_steps_identically(
    info: ConformanceInfo, how: str, device: str
) -> None:
    model = info.model(device)
    opt = info.build(model)
    train(model, opt, range(3))
    frozen = [p.detach().clone() for p in model.parameters()]
    model2, opt2 = CLONES[how]((model, opt))
    opt2.zero_grad()
    train(model2, opt2, range(3, 5))
    for p, before in zip(model.parameters(), frozen, strict=True):
        assert torch.equal(p, before)  # stepping the copy left the original alone
    train(model, opt, range(3, 5))
    assert_same_params(model, model2)
    assert_same_state_dict(opt.state_dict(), opt2.state_dict())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", INFO_PARAMS)
def test_zero_size_parameters_train_and_checkpoint(info: ConformanceInfo, device: str) -> None:
    model = info.model(device)
    empty = nn.Parameter(torch.zeros(0, 8, device=device))
    named = [*model.named_parameters(), ("empty.weight", empty)]
    opt = info.build(named)
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(2):
        feed(model, step)
        empty.grad = torch.zeros_like(empty)
        opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert empty.shape == (0, 8)
    sd = copy.deepcopy(opt.state_dict())
    model2 = info.model(device)
    model2.load_state_dict(model.state_dict())
    empty2 = nn.Parameter(torch.zeros(0, 8, device=device))
    opt2 = info.build([*model2.named_parameters(), ("empty.weight", empty2)])
    opt2.load_state_dict(sd)
    for m, e, o in ((model, empty, opt), (model2, empty2, opt2)):
        feed(m, 2)
        e.grad = torch.zeros_like(e)
        o.step()
    assert_same_params(model, model2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", INFO_PARAMS)
def test_step_with_closure_returns_its_loss_and_steps_on_its_gradients(
    info: ConformanceInfo, device: str
) -> None:
    x = batch(device)
    model, model2 = info.model(device), info.model(device)
    opt, opt2 = info.build(model), info.build(model2)
    calls = []

    def closure() -> torch.Tensor:
        assert torch.is_grad_enabled()  # step() runs it with gradients on
        calls.append(1)
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    for _ in range(2):
        loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor) and loss.ndim == 0
        # The same gradients computed outside, then a step without a closure.
        opt2.zero_grad()
        model2(x).square().mean().backward()
        assert opt2.step() is None
    assert len(calls) == 2
    assert_same_params(model, model2)


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "StepLR": lambda o: lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "MultiplicativeLR": lambda o: lr_scheduler.MultiplicativeLR(o, lambda e: 0.75),
    "ExponentialLR": lambda o: lr_scheduler.ExponentialLR(o, gamma=0.5),
    "CosineAnnealingLR": lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=4),
    "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(
        o, max_lr=[LR] * len(o.param_groups), total_steps=8, cycle_momentum=False
    ),
    "ReduceLROnPlateau": lambda o: lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0),
}


def _advance(sched: Any, step: int) -> None:
    if isinstance(sched, lr_scheduler.ReduceLROnPlateau):
        sched.step(float(step))  # a rising loss: every step is a plateau
    else:
        sched.step()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float_lr", "tensor_lr"])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.parametrize("info", INFO_PARAMS)
def test_schedulers_drive_the_lr_the_step_uses(
    info: ConformanceInfo, name: str, tensor_lr: bool, device: str
) -> None:
    lr = torch.tensor(LR) if tensor_lr else LR
    model = info.model(device)
    opt = info.build(model, lr=lr)
    sched = SCHEDULERS[name](opt)
    seen: list[list[tuple[float, bool]]] = []

    def record(step: int) -> None:
        # Some schedulers replace a tensor lr by a float (ReduceLROnPlateau before torch 2.8).
        seen.append([(float(g["lr"]), isinstance(g["lr"], torch.Tensor)) for g in opt.param_groups])

    for step in range(4):
        train(model, opt, range(step, step + 1), record)
        _advance(sched, step)
    assert len({tuple(s) for s in seen}) > 1, "the scheduler never changed the lr"
    # The same lrs set by hand, step by step, give the same parameters: the step reads them.
    by_hand = info.model(device)
    opt2 = info.build(by_hand, lr=LR)

    def assign(step: int) -> None:
        # The same values and the same kind (torch.optim.AdamW, a backup, rounds a tensor lr
        # differently from a float one).
        for g, (value, as_tensor) in zip(opt2.param_groups, seen[step], strict=True):
            g["lr"] = torch.tensor(value) if as_tensor else value

    train(by_hand, opt2, range(4), assign)
    assert_same_params(model, by_hand)
    constant = info.model(device)
    train(constant, info.build(constant, lr=LR), range(4))
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), constant.parameters()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", INFO_PARAMS)
def test_tensor_lr_steps_as_the_float_and_follows_in_place_changes(
    info: ConformanceInfo, device: str
) -> None:
    lr = torch.tensor(LR)
    model, model2 = info.model(device), info.model(device)
    opt = info.build(model, lr=lr, weight_decay=0.0)
    if _refused_as_torch_adamw_refuses(info, device, model, opt, lr=torch.tensor(LR)):
        return
    # torch.optim.AdamW (the hybrid's "adamw" backup) on CUDA computes with a tensor lr in
    # another order than with the float (its foreach path divides tensors): its twin gets a
    # tensor too. The Muon half's tensor lr is checked against the float in GefenMuon's case.
    adamw_cuda = info.kwargs.get("backup_optimizer") == "adamw" and device == "cuda"
    opt2 = info.build(model2, lr=torch.tensor(LR) if adamw_cuda else LR, weight_decay=0.0)
    train(model, opt, range(3))
    train(model2, opt2, range(3))
    assert_same_params(model, model2)
    assert all(g["lr"] is lr for g in opt.param_groups)  # kept as the caller's tensor
    lr.fill_(0.0)  # changed in place: the next step must see it
    frozen = [p.detach().clone() for p in model.parameters()]
    train(model, opt, range(3, 4))
    for p, before in zip(model.parameters(), frozen, strict=True):
        assert torch.equal(p, before)


def _betas_cases() -> list[Any]:
    cases = []
    for info in INFOS:
        if not info.accepts_betas:
            continue
        for capturable in (False, True):
            for device in DEVICES:
                # torch.optim.AdamW (the hybrid's "adamw" backup) steps capturable on CUDA only.
                adamw = info.kwargs.get("backup_optimizer") == "adamw"
                if capturable and adamw and device.values[0] == "cpu":
                    continue
                cases.append(
                    pytest.param(
                        info,
                        capturable,
                        device.values[0],
                        marks=device.marks,
                        id=f"{info.id}-{'capturable' if capturable else 'eager'}-{device.id}",
                    )
                )
    return cases


@pytest.mark.parametrize(("info", "capturable", "device"), _betas_cases())
def test_tensor_betas_step_as_the_floats_and_follow_in_place_changes(
    info: ConformanceInfo, capturable: bool, device: str
) -> None:
    betas = (torch.tensor(0.875, device=device), torch.tensor(0.9921875, device=device))
    model, model2 = info.model(device), info.model(device)
    opt = info.build(model, betas=betas, capturable=capturable)
    if _refused_as_torch_adamw_refuses(info, device, model, opt,
                                       betas=tuple(b.clone() for b in betas),
                                       capturable=capturable):
        return
    # Gefen reads tensor betas as the same floats. torch.optim.AdamW (the hybrid's "adamw"
    # backup) computes with tensor betas in another order: its twin gets tensors too.
    adamw = info.kwargs.get("backup_optimizer") == "adamw"
    twin: tuple[Any, Any] = tuple(b.clone() for b in betas) if adamw else (0.875, 0.9921875)
    opt2 = info.build(model2, betas=twin, capturable=capturable)
    train(model, opt, range(3))
    train(model2, opt2, range(3))
    assert_same_params(model, model2)
    # A scheduler-style in-place change is stepped with, as a float assigned to the group is.
    betas[0].fill_(0.5)
    if adamw:
        twin[0].fill_(0.5)
    else:
        for g in opt2.param_groups:
            if "momentum" not in g:  # the Muon half has no betas
                g["betas"] = (0.5, g["betas"][1])
    train(model, opt, range(3, 5))
    train(model2, opt2, range(3, 5))
    assert_same_params(model, model2)
    sd = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(sd)  # tensor betas checkpoint and load
    assert_same_state_dict(sd, opt.state_dict())


def _refused_as_torch_adamw_refuses(
    info: ConformanceInfo, device: str, model: nn.Module, opt: Any, **kwargs: Any
) -> bool:
    """For a hybrid with the ``"adamw"`` backup: whether ``torch.optim.AdamW`` itself refuses
    these arguments on ``device`` when it steps (on CUDA its default foreach path raises for a
    tensor ``lr`` or ``betas`` unless ``capturable``); if so, assert the hybrid's step raises
    the same error. Gefen and a Gefen backup accept them everywhere."""
    if info.kwargs.get("backup_optimizer") != "adamw":
        return False
    p = torch.zeros(2, device=device, requires_grad=True)
    p.grad = torch.ones_like(p)
    try:
        torch.optim.AdamW([p], **kwargs).step()
    except (RuntimeError, ValueError) as exc:
        with pytest.raises(type(exc), match=re.escape(str(exc))):
            train(model, opt, range(1))
        return True
    return False
