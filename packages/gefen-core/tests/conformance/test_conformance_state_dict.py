"""torch.optim's checkpoint contracts for every Gefen-family optimizer (conformance_registry).

* ``state_dict()`` → ``torch.save`` → ``torch.load(weights_only=True)`` → ``load_state_dict``
  resumes bit-identically;
* the four checkpoint hooks run where torch.optim runs them, and their results are used;
* entries of ``optimizer.state`` whose key is not a parameter survive the round trip;
* a checkpoint of an optimizer built on ``model.parameters()`` loads into one built on
  ``model.named_parameters()`` and keeps the live names; the other way round the saved names
  are taken (torch.optim's rule for ``param_names``);
* a wrapper that rebinds ``param_groups[i]["params"]`` before the first step (flat parameters)
  leaves an optimizer that loads its own checkpoint and steps every rebound tensor.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from conformance_registry import (
    DEVICES,
    INFO_PARAMS,
    INFOS,
    ConformanceInfo,
    assert_same_params,
    assert_same_state_dict,
    feed,
    train,
)

UNNAMED = [pytest.param(i, id=i.id) for i in INFOS if not i.named_only]


def _through_torch_save(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", INFO_PARAMS)
def test_round_trip_through_torch_save_resumes_bit_identically(
    info: ConformanceInfo, device: str
) -> None:
    model = info.model(device)
    opt = info.build(model)
    train(model, opt, range(3))
    saved_model = copy.deepcopy(model.state_dict())
    sd = _through_torch_save(opt.state_dict())
    train(model, opt, range(3, 5))

    resumed = info.model(device)
    resumed.load_state_dict(saved_model)
    opt2 = info.build(resumed)
    opt2.load_state_dict(sd)
    train(resumed, opt2, range(3, 5))
    assert_same_params(model, resumed)
    assert_same_state_dict(opt.state_dict(), opt2.state_dict())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", INFO_PARAMS)
def test_checkpoint_hooks_run_in_torch_order_and_their_results_are_used(
    info: ConformanceInfo, device: str
) -> None:
    model = info.model(device)
    opt = info.build(model)
    train(model, opt, range(2))
    calls: list[str] = []

    def save_pre(o: torch.optim.Optimizer) -> None:
        assert o is opt
        calls.append("save_pre")
        o.state["hook_counter"] = 7  # a key the pre-hook adds is part of the checkpoint

    def save_post(o: torch.optim.Optimizer, sd: dict) -> dict:
        calls.append("save_post")
        return {**sd, "wrapped_by_hook": True}  # a returned dict replaces the result

    opt.register_state_dict_pre_hook(save_pre)
    opt.register_state_dict_post_hook(save_post)
    sd = opt.state_dict()
    assert calls == ["save_pre", "save_post"]
    assert sd["wrapped_by_hook"] is True

    fresh_model = info.model(device)
    opt2 = info.build(fresh_model)
    lr_seen_by_post: list[float] = []

    def load_pre(o: torch.optim.Optimizer, given: dict) -> dict:
        calls.append("load_pre")
        assert given is not sd  # torch passes a shallow copy
        out = dict(given)
        out.pop("wrapped_by_hook")
        return out

    def load_post(o: torch.optim.Optimizer) -> None:
        calls.append("load_post")
        lr_seen_by_post.extend(float(g["lr"]) for g in o.param_groups)

    opt2.register_load_state_dict_pre_hook(load_pre)
    opt2.register_load_state_dict_post_hook(load_post)
    for g in opt2.param_groups:
        g["lr"] = 0.5  # the checkpoint's lr must be in place when the post-hook runs
    opt2.load_state_dict(sd)
    assert calls == ["save_pre", "save_post", "load_pre", "load_post"]
    assert lr_seen_by_post == [float(g["lr"]) for g in opt.param_groups]
    assert opt2.state["hook_counter"] == 7
    assert "wrapped_by_hook" not in opt2.state_dict()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", INFO_PARAMS)
def test_non_parameter_state_keys_survive_state_dict_and_load(
    info: ConformanceInfo, device: str
) -> None:
    model = info.model(device)
    opt = info.build(model)
    train(model, opt, range(2))
    opt.state["scheduler_note"] = {"epoch": 3, "scale": torch.tensor([2.0])}
    opt.state["flag"] = 1
    sd = _through_torch_save(opt.state_dict())
    opt2 = info.build(info.model(device))
    opt2.load_state_dict(sd)
    assert opt2.state["flag"] == 1
    assert opt2.state["scheduler_note"]["epoch"] == 3
    assert torch.equal(opt2.state["scheduler_note"]["scale"], torch.tensor([2.0]))
    # ... and the parameters' own state loaded beside them.
    for p, q in zip(_params(opt), _params(opt2), strict=True):
        assert set(opt.state[p]) == set(opt2.state[q])


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", UNNAMED)
def test_unnamed_checkpoint_into_named_optimizer_keeps_live_names(
    info: ConformanceInfo, device: str
) -> None:
    model = info.model(device)
    unnamed = info.build(model, named=False)
    train(model, unnamed, range(2))
    sd = copy.deepcopy(unnamed.state_dict())  # state_dict() returns live tensors
    saved_model = copy.deepcopy(model.state_dict())
    train(model, unnamed, range(2, 4))

    resumed = info.model(device)
    resumed.load_state_dict(saved_model)
    named = info.build(resumed, named=True)
    live = [list(g["param_names"]) for g in named.param_groups]
    assert live == [[n for n, _ in resumed.named_parameters()]]
    named.load_state_dict(sd)
    assert [list(g["param_names"]) for g in named.param_groups] == live
    assert not any(f for g in named.param_groups for f in g["param_names_synthesized"])
    train(resumed, named, range(2, 4))
    assert_same_params(model, resumed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", UNNAMED)
def test_named_checkpoint_into_unnamed_optimizer_takes_the_saved_names(
    info: ConformanceInfo, device: str
) -> None:
    model = info.model(device)
    named = info.build(model, named=True)
    train(model, named, range(2))
    sd = copy.deepcopy(named.state_dict())
    saved_model = copy.deepcopy(model.state_dict())
    train(model, named, range(2, 4))

    resumed = info.model(device)
    resumed.load_state_dict(saved_model)
    unnamed = info.build(resumed, named=False)
    unnamed.load_state_dict(sd)
    assert [list(g["param_names"]) for g in unnamed.param_groups] == [
        list(g["param_names"]) for g in named.param_groups
    ]
    train(resumed, unnamed, range(2, 4))
    assert_same_params(model, resumed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("info", INFO_PARAMS)
def test_params_rebound_by_a_wrapper_before_the_first_step(
    info: ConformanceInfo, device: str
) -> None:
    model = info.model(device)
    opt = info.build(model)
    group = opt.param_groups[0]
    # What FSDP/Accelerate-style wrappers do: the group now holds other tensors, one more.
    rebound = [p.detach().clone().requires_grad_() for p in group["params"]]
    rebound.append(torch.randn_like(rebound[0]).requires_grad_())
    group["params"] = rebound
    opt.load_state_dict(opt.state_dict())  # its own checkpoint loads

    before = [p.detach().clone() for p in rebound]
    for step in range(2):
        feed(model, step)
        gen = torch.Generator().manual_seed(50 + step)
        for p in rebound:
            p.grad = torch.randn(p.shape, generator=gen).to(p.device)
        opt.step()
    for i, (p, b) in enumerate(zip(rebound, before)):
        assert not torch.equal(p, b), f"rebound tensor {i} was not stepped"
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    assert_same_state_dict(sd, opt.state_dict())
