"""Test registry for Gefen-family optimizers (after torch's ``OptimizerInfo``).

Each :class:`OptimizerInfo` names an optimizer class, a generator of valid constructor inputs
(:class:`OptimizerInput`) and a generator of invalid ones with the exception they must raise
(:class:`ErrorOptimizerInput`). Generic tests (``tests/test_registry.py`` here, and
``gefen_dist``'s suite) iterate :data:`optim_db`, so a new optimizer or option gets the
state-dict round trip, path-parity and error checks by adding an entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .optimizer import Gefen

__all__ = ["ErrorOptimizerInput", "OptimizerInfo", "OptimizerInput", "optim_db"]


@dataclass(frozen=True)
class OptimizerInput:
    """Keyword arguments for one valid construction, and a short description for test ids."""

    kwargs: dict[str, Any]
    desc: str


@dataclass(frozen=True)
class ErrorOptimizerInput:
    """An invalid construction: ``params`` (``None`` = a default small parameter list),
    keyword arguments, and the exception type and message regex it must raise."""

    kwargs: dict[str, Any]
    error_type: type[BaseException]
    error_regex: str
    desc: str
    params: Callable[[], Any] | None = None


@dataclass(frozen=True)
class OptimizerInfo:
    """One optimizer under test.

    Attributes:
        optim_cls: the optimizer class.
        optim_inputs_func: ``(device) -> list[OptimizerInput]`` of valid configurations.
        optim_error_inputs_func: ``(device) -> list[ErrorOptimizerInput]``.
        supported_impls: implementation flags the class understands (``"foreach"``,
            ``"fused"``).
        fused_devices: device types with a fused implementation.
        reference_cls: the ``torch.optim`` class whose signature and defaults it copies.
    """

    optim_cls: type[torch.optim.Optimizer]
    optim_inputs_func: Callable[[str], list[OptimizerInput]]
    optim_error_inputs_func: Callable[[str], list[ErrorOptimizerInput]]
    supported_impls: tuple[str, ...] = ("foreach", "fused")
    fused_devices: tuple[str, ...] = ("cuda",)
    reference_cls: type[torch.optim.Optimizer] | None = None
    skips: dict[str, str] = field(default_factory=dict)


def gefen_inputs(device: str) -> list[OptimizerInput]:
    """Valid Gefen configurations covering each option at least once."""
    return [
        OptimizerInput({}, "defaults"),
        OptimizerInput({"lr": 3e-3, "weight_decay": 0.0}, "no_decay"),
        OptimizerInput({"lr": torch.tensor(2e-3), "betas": (0.8, 0.95)}, "tensor_lr"),
        OptimizerInput({"betas": (torch.tensor(0.8), torch.tensor(0.95))}, "tensor_betas"),
        OptimizerInput({"maximize": True, "weight_decay": 0.1}, "maximize"),
        OptimizerInput({"factored_v_2d": False}, "block_mode"),
        OptimizerInput({"stochastic_round": True}, "stochastic_round"),
        OptimizerInput({"period_search": "variance"}, "variance_search"),
        OptimizerInput({"force_1d_period_one": True, "force_2d_period_one": True},
                       "forced_period_one"),
        OptimizerInput({"period_one_substrings": ("bias",)}, "substrings"),
        OptimizerInput({"deterministic": True}, "deterministic"),
        OptimizerInput({"capturable": True}, "capturable"),
        OptimizerInput({"foreach": True}, "foreach"),
        OptimizerInput({"foreach": False}, "for_loop"),
        OptimizerInput({"codebook_refresh_every": 2}, "refresh"),
        OptimizerInput({"skip_nonfinite": True}, "skip_nonfinite"),
    ]


def gefen_error_inputs(device: str) -> list[ErrorOptimizerInput]:
    """Invalid Gefen configurations and the error each must raise (docs/algorithm.md#overview)."""
    E = ErrorOptimizerInput
    errors = [
        E({"lr": -1e-3}, ValueError, r"^Invalid learning rate: -0\.001", "negative_lr"),
        E({"lr": torch.tensor([1e-3, 2e-3])}, ValueError, "^Tensor lr must be 1-element",
          "lr_2_elems"),
        E({"lr": float("nan")}, ValueError, "^Invalid learning rate: nan", "nan_lr"),
        E({"betas": (1.0, 0.999)}, ValueError, "^Invalid beta parameter at index 0",
          "beta1_one"),
        E({"betas": (0.9, -0.1)}, ValueError, "^Invalid beta parameter at index 1",
          "beta2_negative"),
        E({"betas": (0.9,)}, ValueError, "two entries", "betas_len"),
        E({"betas": (torch.tensor(0.9), 0.99)}, ValueError,
          "^betas must be either both floats or both Tensors", "tensor_and_float_betas"),
        E({"eps": 0.0}, ValueError, "^Invalid epsilon value: 0.0", "zero_eps"),
        E({"eps": float("inf")}, ValueError, "^Invalid epsilon value: inf", "inf_eps"),
        E({"weight_decay": -0.1}, ValueError, r"^Invalid weight_decay value: -0\.1",
          "negative_wd"),
        E({"differentiable": True}, RuntimeError, "differentiable=True", "differentiable"),
        E({"amsgrad": True}, RuntimeError, "amsgrad=True", "amsgrad"),
        E({"fused": True, "foreach": True}, RuntimeError,
          "^`fused` and `foreach` cannot be `True` together", "fused_and_foreach"),
        E({"period_search": "magic"}, ValueError, "period_search", "bad_variant"),
        E({"period_one_substrings": "bias"}, TypeError, r"write \('bias',\)", "bare_string"),
        E({"deterministic": 1}, TypeError, "deterministic must be a bool", "deterministic_int"),
        E({"maximize": "yes"}, TypeError, "maximize must be a bool", "maximize_str"),
        E({"codebook_refresh_every": -1}, ValueError, "codebook_refresh_every", "refresh_neg"),
        E({"capturable": True, "codebook_refresh_every": 5}, ValueError,
          "capturable=True", "capturable_refresh"),
        E({"skip_nonfinite": "yes"}, TypeError, "skip_nonfinite must be a bool", "skip_str"),
        E({"capturable": True, "skip_nonfinite": True}, ValueError, "capturable",
          "capturable_skip"),
        E({}, ValueError, "empty parameter list", "empty_params", params=lambda: []),
        E({}, TypeError, "^optimizer can only optimize Tensors", "non_tensor",
          params=lambda: [1.0]),
        E({}, ValueError, "complex", "complex_param",
          params=lambda: [torch.zeros(3, dtype=torch.complex64, requires_grad=True)]),
        E({}, ValueError, "twice", "duplicate_param",
          params=lambda: (lambda t: [t, t])(torch.zeros(3, requires_grad=True))),
        E({}, ValueError, "more than one parameter group", "param_in_two_groups",
          params=lambda: (lambda t: [{"params": [t]}, {"params": [t]}])(
              torch.zeros(3, requires_grad=True))),
        E({}, ValueError, "needs a 'params' entry", "group_without_params",
          params=lambda: [{"lr": 1.0}]),
        E({}, TypeError, "^optimizer parameters need to be organized in ordered collections",
          "set_of_params",
          params=lambda: [{"params": {torch.zeros(3, requires_grad=True)}}]),
    ]
    if device == "cpu":
        errors.append(E({"fused": True}, RuntimeError, "fused=True cannot be honoured",
                        "fused_on_cpu"))
    return errors


optim_db: list[OptimizerInfo] = [
    OptimizerInfo(
        optim_cls=Gefen,
        optim_inputs_func=gefen_inputs,
        optim_error_inputs_func=gefen_error_inputs,
        reference_cls=torch.optim.AdamW,
    ),
]
