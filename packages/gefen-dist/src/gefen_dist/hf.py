"""Gefen with the Hugging Face ``Trainer`` / Accelerate, and the axolotl-style names
(docs/algorithm.md#distributed).

Three ways to give the Trainer a Gefen optimizer:

* plain Gefen, built by the Trainer (which also applies its decay / no-decay parameter
  groups)::

      Trainer(..., optimizer_cls_and_kwargs=gefen_optimizer_cls_and_kwargs(args))
      # == (Gefen, {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
      #            "eps": args.adam_epsilon, "weight_decay": args.weight_decay, "fused": None})

* the hybrid, which splits the model's parameters at construction, built yourself::

      Trainer(..., optimizers=(GefenMuonHybrid(model, **hybrid_kwargs(args)), None))

  or built by the Trainer from the model it trains, through its factory protocol::

      Trainer(..., optimizer_cls_and_kwargs=(GefenMuonHybridFactory, hybrid_kwargs(args)))

* by name, as axolotl does: :func:`create_optimizer` with ``"gefenx"`` (``Gefen``) or
  ``"gefenx_muon"`` (``GefenMuonHybrid``) and an ``optim_args`` string or dict.

:data:`RECIPES` holds the recommended settings of docs/algorithm.md#distributed. Nothing here
imports ``transformers``: ``args`` is anything with the ``TrainingArguments`` attribute names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gefen_core import Gefen

__all__ = [
    "GEFENX_NAMES",
    "RECIPES",
    "GefenMuonHybridFactory",
    "create_optimizer",
    "gefen_kwargs",
    "gefen_optimizer_cls_and_kwargs",
    "hybrid_kwargs",
    "parse_optim_args",
    "recipe",
]

#: axolotl-style optimizer names (docs/algorithm.md#distributed) and the class each builds.
GEFENX_NAMES = ("gefenx", "gefenx_muon")

#: The recommended recipes of docs/algorithm.md#distributed as GefenMuonHybrid / Gefen keyword
#: arguments, with learning rates as multiples of the recipe's base ``lr`` (resolved by
#: :func:`recipe`).
RECIPES: dict[str, dict[str, Any]] = {
    # plain Gefen SFT: lr ~ 0.6 x the AdamW lr; weight decay scaled by ~1/0.6 to keep lr*wd.
    "gefen_sft": {"optimizer": "gefen", "lr_scale": 0.6, "weight_decay_scale": 1 / 0.6},
    "muon_balanced_sft": {
        "optimizer": "gefen_muon_hybrid", "backup_optimizer": "adamw", "backup_lr_scale": 1.0,
        "ns_schedule": "tuned3", "normuon": True, "adjust_lr_fn": "match_rms_adamw",
    },
    "muon_quality_pretraining": {
        "optimizer": "gefen_muon_hybrid", "backup_optimizer": "adamw", "backup_lr_scale": 1.0,
        "ns_schedule": "standard", "ns_steps": 5, "normuon": False,
    },
    "muon_lowest_memory": {
        "optimizer": "gefen_muon_hybrid", "backup_optimizer": "gefen", "backup_lr_scale": 0.5,
        "backup_1d_period_one": True, "ns_schedule": "tuned3", "normuon": True,
    },
}

_GEFEN_OPTIM_ARGS: dict[str, type] = {"fused": bool, "deterministic": bool, "factored_v_2d": bool}
_HYBRID_OPTIM_ARGS: dict[str, type] = {
    "fused": bool, "deterministic": bool, "backup_optimizer": str, "backup_lr": float,
    "ns_schedule": str, "normuon": bool, "sharded_mode": str,
}
_ALIASES = {"gefen_deterministic": "deterministic", "use_deterministic": "deterministic"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _attr(args: Any, name: str) -> Any:
    try:
        return getattr(args, name)
    except AttributeError:
        raise TypeError(
            f"args has no attribute {name!r}; pass a transformers.TrainingArguments (or an "
            "object with its learning_rate, adam_beta1, adam_beta2, adam_epsilon, weight_decay)"
        ) from None


def gefen_kwargs(args: Any, **overrides: Any) -> dict[str, Any]:
    """``TrainingArguments`` fields as :class:`gefen_core.Gefen` keyword arguments
    (docs/algorithm.md#distributed).

    ``learning_rate`` -> ``lr``; ``(adam_beta1, adam_beta2)`` -> ``betas``; ``adam_epsilon`` ->
    ``eps``; ``weight_decay`` -> ``weight_decay``; plus ``fused=None``: the fused kernels on
    CUDA tensors, the PyTorch path elsewhere. (The earlier releases' recipe used ``fused=True``;
    gefen_core's ``Gefen`` raises for ``fused=True`` on CPU tensors, so pass it explicitly only when
    every parameter is on CUDA and the kernels must be used.)

    Args:
        args: a ``TrainingArguments`` (or any object with those attributes).
        **overrides: Gefen keyword arguments that replace or extend the mapped ones.

    Returns:
        A new dict of keyword arguments.

    Raises:
        TypeError: ``args`` lacks one of the fields.
    """
    out: dict[str, Any] = {
        "lr": float(_attr(args, "learning_rate")),
        "betas": (float(_attr(args, "adam_beta1")), float(_attr(args, "adam_beta2"))),
        "eps": float(_attr(args, "adam_epsilon")),
        "weight_decay": float(_attr(args, "weight_decay")),
        "fused": None,
    }
    out.update(overrides)
    return out


def gefen_optimizer_cls_and_kwargs(args: Any, **overrides: Any) -> tuple[type[Gefen], dict]:
    """``(Gefen, gefen_kwargs(args, **overrides))`` for ``Trainer(optimizer_cls_and_kwargs=...)``.

    The Trainer passes its decay / no-decay groups as the parameters and the group's own
    ``weight_decay`` wins over the kwargs' one, exactly as for ``torch.optim.AdamW``.
    """
    return Gefen, gefen_kwargs(args, **overrides)


def hybrid_kwargs(args: Any, **overrides: Any) -> dict[str, Any]:
    """``TrainingArguments`` fields as ``GefenMuonHybrid`` keyword arguments.

    Same mapping as :func:`gefen_kwargs` (``betas``/``eps`` apply to the backup half; the Muon
    half keeps its own eps, docs/algorithm.md#hybrid). ``weight_decay`` is the shared decay of both
    halves.
    """
    return gefen_kwargs(args, **overrides)


class GefenMuonHybridFactory:
    """Trainer factory protocol for the hybrid: ``optimizer_cls_and_kwargs=(
    GefenMuonHybridFactory, kwargs)``.

    ``transformers`` treats a first element that is not an ``Optimizer`` class as a factory: it
    instantiates it with no arguments and calls it with ``(model, **kwargs)``, so the hybrid is
    split from the model the Trainer trains (docs/algorithm.md#hybrid) rather than from the
    Trainer's flat groups. Older ``transformers`` releases without that protocol call the class with
    the parameter groups instead; that raises a ``TypeError`` pointing to ``optimizers=(hybrid,
    None)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise TypeError(
                "GefenMuonHybridFactory was called like an optimizer class: this transformers "
                "version has no optimizer-factory protocol. Build the hybrid yourself and pass "
                "Trainer(optimizers=(GefenMuonHybrid(model, **kwargs), None))"
            )

    def __call__(self, model: nn.Module, **kwargs: Any) -> torch.optim.Optimizer:
        from gefen_core.hybrid import GefenMuonHybrid

        if not isinstance(model, nn.Module):
            raise TypeError(f"GefenMuonHybridFactory needs the model, got {type(model).__name__}")
        return GefenMuonHybrid(model, **kwargs)


def _coerce(name: str, key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"optim_args[{key!r}] for {name!r} must be a boolean "
                         f"(true/false/1/0), got {value!r}")
    if kind is float:
        if isinstance(value, bool):
            raise ValueError(f"optim_args[{key!r}] for {name!r} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"optim_args[{key!r}] for {name!r} must be a number, "
                             f"got {value!r}") from None
    return str(value).strip()


def parse_optim_args(name: str, optim_args: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Parse axolotl / ``TrainingArguments.optim_args`` for a ``gefenx`` name
    (docs/algorithm.md#distributed).

    Args:
        name: ``"gefenx"`` or ``"gefenx_muon"``.
        optim_args: ``"key=value,key=value"`` (the Trainer's string form), a dict, or ``None``.

    Accepted keys: ``fused``, ``deterministic`` (also ``gefen_deterministic``), and
    ``factored_v_2d`` for ``gefenx``; ``fused``, ``deterministic``, ``backup_optimizer``,
    ``backup_lr``, ``ns_schedule``, ``normuon``, ``sharded_mode`` for ``gefenx_muon``. String
    values are coerced to the argument's type (``"true"``/``"0"`` -> bool, ``"5e-4"`` -> float).

    Returns:
        The keyword arguments, with canonical key names.

    Raises:
        ValueError: unknown ``name``; a malformed ``key=value`` item; an unknown key (the
            message lists the accepted ones); a value that cannot be coerced; a key given twice.
    """
    if name not in GEFENX_NAMES:
        raise ValueError(f"optimizer name must be one of {GEFENX_NAMES}, got {name!r}")
    allowed = _GEFEN_OPTIM_ARGS if name == "gefenx" else _HYBRID_OPTIM_ARGS
    if optim_args is None:
        items: list[tuple[str, Any]] = []
    elif isinstance(optim_args, str):
        items = []
        for part in optim_args.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"optim_args for {name!r}: expected key=value, got {part!r}")
            items.append((key.strip(), value.strip()))
    elif isinstance(optim_args, Mapping):
        items = [(str(k), v) for k, v in optim_args.items()]
    else:
        raise TypeError(f"optim_args must be a 'k=v,k=v' string or a dict, "
                        f"got {type(optim_args).__name__}")
    out: dict[str, Any] = {}
    for key, value in items:
        canon = _ALIASES.get(key, key)
        if canon not in allowed:
            raise ValueError(f"optim_args key {key!r} is not accepted for {name!r}; accepted: "
                             f"{sorted(allowed) + sorted(k for k, v in _ALIASES.items())}")
        if canon in out:
            raise ValueError(f"optim_args for {name!r} gives {canon!r} twice")
        out[canon] = _coerce(name, key, value, allowed[canon])
    return out


def recipe(name: str, lr: float, weight_decay: float = 0.0) -> tuple[str, dict[str, Any]]:
    """A recipe of :data:`RECIPES` resolved at base learning rate ``lr``
    (docs/algorithm.md#distributed).

    Returns:
        ``(optimizer, kwargs)`` with ``optimizer`` ``"gefen"`` or ``"gefen_muon_hybrid"``.

    Raises:
        ValueError: unknown recipe name (the message lists them).
    """
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    spec = dict(RECIPES[name])
    optimizer = spec.pop("optimizer")
    kw: dict[str, Any] = {"lr": lr * spec.pop("lr_scale", 1.0),
                          "weight_decay": weight_decay * spec.pop("weight_decay_scale", 1.0)}
    if "backup_lr_scale" in spec:
        kw["backup_lr"] = lr * spec.pop("backup_lr_scale")
    kw.update(spec)
    return optimizer, kw


def create_optimizer(
    name: str,
    model: nn.Module,
    args: Any,
    optim_args: str | Mapping[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """The axolotl-style factory: build ``gefenx`` / ``gefenx_muon`` for ``model``
    (docs/algorithm.md#distributed).

    * ``gefenx`` -> ``Gefen(model.named_parameters(), **gefen_kwargs(args), **optim_args)``
      over the trainable parameters.
    * ``gefenx_muon`` -> ``GefenMuonHybrid(model, ...)`` with ``learning_rate``,
      ``weight_decay``, ``adam_beta1/2`` and ``adam_epsilon`` forwarded, defaulting to the
      low-memory Gefen-backup recipe (:data:`RECIPES` ``"muon_lowest_memory"``:
      ``backup_lr = 0.5 x learning_rate``, ``backup_1d_period_one=True``, ``tuned3``,
      NorMuon). With ``backup_optimizer=adamw`` in ``optim_args`` the default ``backup_lr``
      becomes ``learning_rate`` (the balanced recipe). ``optim_args`` wins over the defaults.

    Args:
        name: ``"gefenx"`` or ``"gefenx_muon"``.
        model: the model to train (the hybrid splits it; the tied LM head is routed once).
        args: ``TrainingArguments`` or an object with its field names.
        optim_args: see :func:`parse_optim_args`.

    Raises:
        ValueError, TypeError: as :func:`parse_optim_args` and :func:`gefen_kwargs`; and the
            optimizer constructors' own errors.
    """
    extra = parse_optim_args(name, optim_args)
    base = gefen_kwargs(args)
    if name == "gefenx":
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("gefenx: the model has no trainable parameters")
        return Gefen(named, **{**base, **extra})
    from gefen_core.hybrid import GefenMuonHybrid

    backup = extra.get("backup_optimizer", "gefen")
    _, defaults = recipe("muon_lowest_memory" if backup == "gefen" else "muon_balanced_sft",
                         base["lr"], base["weight_decay"])
    if backup != "gefen":
        defaults.pop("backup_1d_period_one", None)
    kw = {**base, **defaults, **extra}
    return GefenMuonHybrid(model, **kw)
