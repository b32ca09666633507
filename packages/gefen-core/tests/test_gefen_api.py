"""Gefen's public surface: signature, defaults, validation, parameter forms, names, dispatch."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch import nn

import gefen_core
from gefen_core import Gefen
from gefen_core.testing import optim_db


def test_exports_and_version() -> None:
    assert set(gefen_core.__all__) >= {"Gefen", "gefen", "__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", gefen_core.__version__)
    assert callable(gefen_core.gefen)


def test_kernel_api_version_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    import gefen_kernels

    monkeypatch.setattr(gefen_kernels, "KERNEL_API_VERSION", 999)
    with pytest.raises(ImportError, match=r"KERNEL_API_VERSION in \[1, 1\].*999"):
        gefen_core._check_kernel_api()


def test_signature_matches_adamw() -> None:
    ours = inspect.signature(Gefen).parameters
    theirs = inspect.signature(torch.optim.AdamW).parameters
    for name, ref in theirs.items():
        assert name in ours, name
        assert ours[name].kind == ref.kind, name
        assert ours[name].default == ref.default, (name, ours[name].default, ref.default)
    # Gefen options come after AdamW's and are keyword-only.
    extra = [p for n, p in ours.items() if n not in theirs]
    assert extra and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)
    assert ours["factored_v_2d"].default is True
    assert ours["period_search"].default == "log_contrast"


def test_docstring_carries_the_contract() -> None:
    doc = Gefen.__doc__
    assert doc is not None
    for needle in ("\\begin{aligned}", "Args:", "State:", "Raises:", "References:",
                   "2606.13894", "exp_avg_codes", "bytes/param", "fused=None"):
        assert needle in doc, needle
    assert "{maximize}" not in doc and "{dispatch}" not in doc


def _params() -> list[torch.Tensor]:
    return [torch.zeros(4, 3, requires_grad=True), torch.zeros(3, requires_grad=True)]


@pytest.mark.parametrize("info", optim_db, ids=lambda i: i.optim_cls.__name__)
def test_error_inputs(info) -> None:  # noqa: ANN001
    for err in info.optim_error_inputs_func("cpu"):
        params = err.params() if err.params is not None else _params()
        with pytest.raises(err.error_type, match=err.error_regex):
            info.optim_cls(params, **err.kwargs)


def test_valid_inputs_construct() -> None:
    for info in optim_db:
        for inp in info.optim_inputs_func("cpu"):
            opt = info.optim_cls(_params(), **inp.kwargs)
            assert len(opt.param_groups) == 1


def test_group_level_validation_names_the_group() -> None:
    a, b = _params()
    with pytest.raises(ValueError, match=r"^Invalid learning rate: -1\.0 \(Gefen param group 1"):
        Gefen([{"params": [a]}, {"params": [b], "lr": -1.0}])


def test_parameter_forms_and_names() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = Gefen(model.named_parameters())
    assert opt.param_groups[0]["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert opt.param_groups[0]["param_names_synthesized"] == [False] * 4

    opt = Gefen(model.parameters())
    assert opt.param_groups[0]["param_names"] == [f"param_{j}" for j in range(4)]
    assert all(opt.param_groups[0]["param_names_synthesized"])

    # Mixed list, upper-case caller names are lower-cased, a single tensor is accepted.
    w = torch.zeros(2, requires_grad=True)
    opt = Gefen([("Emb.Weight", model[0].weight), model[0].bias])
    assert opt.param_groups[0]["param_names"] == ["emb.weight", "param_1"]
    assert Gefen(w).param_groups[0]["param_names"] == ["param_0"]

    # Group dicts: extras kept, beta1/beta2 accepted and stored as betas (O1), group names.
    opt = Gefen([
        {"params": [model[0].weight], "name": "Head", "my_tag": 7, "beta1": 0.8, "beta2": 0.9},
        {"params": [model[0].bias, model[1].weight], "lr": 0.5},
        {"params": [("head", model[1].bias)]},
    ])
    g0, g1, g2 = opt.param_groups
    assert g0["my_tag"] == 7 and g0["betas"] == (0.8, 0.9) and "beta1" not in g0
    assert g0["param_names"] == ["head"] and g0["name"] == "head"
    assert g1["param_names"] == ["group_1_param_0", "group_1_param_1"] and g1["lr"] == 0.5
    assert g2["param_names"] == ["head_1"] and g2["param_names_synthesized"] == [True]
    assert g1["betas"] == (0.9, 0.999) and g1["weight_decay"] == 1e-2


def test_betas_and_split_betas_conflict() -> None:
    with pytest.raises(ValueError, match="not both"):
        Gefen([{"params": _params(), "betas": (0.9, 0.9), "beta1": 0.9, "beta2": 0.9}])
    with pytest.raises(ValueError, match="together"):
        Gefen([{"params": _params(), "beta1": 0.9}])


def test_add_param_group_is_all_or_nothing() -> None:
    a, b, c = (torch.zeros(3, requires_grad=True) for _ in range(3))
    opt = Gefen([a])
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [b, a]})  # a is already registered
    with pytest.raises(ValueError, match="eps"):
        opt.add_param_group({"params": [b], "eps": -1.0})
    with pytest.raises(TypeError):
        opt.add_param_group({"params": [b, "not a tensor"]})
    assert len(opt.param_groups) == 1 and opt.param_groups[0].keys() == before[0].keys()
    opt.add_param_group({"params": [("late", b), c], "lr": 0.1})
    assert opt.param_groups[1]["param_names"] == ["late", "group_1_param_1"]


def test_frozen_parameters_are_registered() -> None:
    w = torch.zeros(3, requires_grad=False)
    opt = Gefen([w])
    assert opt.param_groups[0]["params"][0] is w


def test_dispatch_on_cpu_and_explicit_fused_refusal() -> None:
    model = nn.Linear(4, 3)
    assert set(Gefen(model.parameters()).step_paths().values()) == {"for_loop"}
    assert set(Gefen(model.parameters(), foreach=True).step_paths().values()) == {"foreach"}
    with pytest.raises(RuntimeError, match="fused=True cannot be honoured for parameter "
                                           "'weight'.*CUDA"):
        Gefen(model.named_parameters(), fused=True)
    # fp64 is refused by the fused path too, whatever the device.
    from gefen_core.dispatch import fused_blocker

    assert fused_blocker(torch.zeros(2, dtype=torch.float64)) is not None


def test_amp_support_is_advertised_only_for_fp16() -> None:
    assert not Gefen([torch.zeros(2, requires_grad=True)])._step_supports_amp_scaling
    assert Gefen([torch.zeros(2, dtype=torch.float16, requires_grad=True)]
                 )._step_supports_amp_scaling
