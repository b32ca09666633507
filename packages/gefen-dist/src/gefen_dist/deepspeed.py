"""Gefen as the client optimizer of DeepSpeed ZeRO (docs/algorithm.md#distributed).

Plain :class:`gefen_core.Gefen` works at ZeRO stages 0-3, with ``offload_optimizer`` to the
CPU (Gefen steps the CPU-resident fp32 partitions on its PyTorch path) and with
``offload_param`` at stage 3. Three DeepSpeed settings decide whether a client optimizer is
used at all, and two of them default the wrong way for Gefen:

* ``"zero_allow_untested_optimizer": true`` — without it DeepSpeed refuses any optimizer it
  does not know at stages 1-3;
* ``"zero_force_ds_cpu_optimizer": false`` — with any ``offload_optimizer`` DeepSpeed
  otherwise refuses a client optimizer (a launcher may instead swap in its own CPU Adam);
* no ``"optimizer"`` section — DeepSpeed would build that optimizer and Gefen would never
  run.

:func:`zero_config_keys` returns the keys to add, :func:`validate_deepspeed_config` checks a
user's config (and the optimizer) before anything is built, and :func:`initialize` does both
and then calls ``deepspeed.initialize``.

The Muon family (``GefenMuon``, ``GefenMuonHybrid``) needs whole 2-D matrices; ZeRO hands the
optimizer flat 1-D fp32 partitions (so do DeepSpeed's fp16/bf16 master-weight wrappers at
stage 0), so it is refused here, before DeepSpeed touches the model, with the alternatives
named (plain Gefen under ZeRO, or the Muon family under FSDP2 / DDP).

This module imports ``deepspeed`` only inside :func:`initialize`; the config helpers work
without it.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from typing import Any

from .capabilities import (
    GEFEN_MUON_CAPABILITIES,
    Layout,
    UnsupportedCombinationError,
    check_capabilities,
)

__all__ = [
    "DeepSpeedConfigError",
    "initialize",
    "name_zero_partitions",
    "track_zero_partitions",
    "validate_deepspeed_config",
    "zero_config_keys",
    "zero_layouts",
]

_OFFLOAD_DEVICES = ("none", "cpu", "nvme")


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config that cannot drive Gefen as the client optimizer."""


def zero_config_keys(*, offload: bool = False) -> dict[str, bool]:
    """The top-level DeepSpeed config keys Gefen needs as a ZeRO client optimizer
    (docs/algorithm.md#distributed).

    Args:
        offload: ``True`` when the config uses ``zero_optimization.offload_optimizer`` (or
            ``offload_param``) with ``device: "cpu"``; adds ``zero_force_ds_cpu_optimizer``.

    Returns:
        A new dict to merge into the config, e.g. ``{"zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False}``. Leave the config's ``optimizer`` section out.
    """
    keys = {"zero_allow_untested_optimizer": True}
    if offload:
        keys["zero_force_ds_cpu_optimizer"] = False
    return keys


def _load(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config, encoding="utf-8") as fh:
                loaded = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise DeepSpeedConfigError(f"config: cannot read DeepSpeed JSON {config!s}: {exc}") \
                from exc
        config = loaded
    if not isinstance(config, Mapping):
        raise DeepSpeedConfigError(
            f"config must be a dict or a path to a DeepSpeed JSON file, got {type(config).__name__}"
        )
    return copy.deepcopy(dict(config))


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def _offload_device(zero: Mapping[str, Any], key: str) -> str:
    section = zero.get(key)
    if section is None:
        return "none"
    if not isinstance(section, Mapping):
        raise DeepSpeedConfigError(
            f"zero_optimization.{key} must be a dict such as {{\"device\": \"cpu\"}}, "
            f"got {section!r}"
        )
    device = str(section.get("device", "none")).lower()
    if device not in _OFFLOAD_DEVICES:
        raise DeepSpeedConfigError(
            f"zero_optimization.{key}.device must be one of {_OFFLOAD_DEVICES}, got {device!r}"
        )
    return device


def zero_layouts(config: Mapping[str, Any] | str | os.PathLike[str]) -> frozenset[Layout]:
    """The parameter layouts the optimizer will see under ``config`` (for capability checks).

    Stages 1-3, and stage 0 with ``fp16``/``bf16`` (DeepSpeed's master-weight wrappers), hand
    the optimizer flat 1-D fp32 partitions (:attr:`Layout.ZERO_FLAT`); stage 0 in fp32 hands it
    the module's own tensors (:attr:`Layout.REPLICATED`). CPU offload adds
    :attr:`Layout.CPU_RESIDENT`.

    Raises:
        DeepSpeedConfigError: as :func:`validate_deepspeed_config` for malformed sections.
    """
    cfg = _load(config)
    zero = cfg.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise DeepSpeedConfigError(f"zero_optimization must be a dict, got {zero!r}")
    stage = zero.get("stage", 0)
    mixed = _enabled(cfg.get("fp16")) or _enabled(cfg.get("bf16")) or _enabled(cfg.get("bfloat16"))
    layouts = {Layout.ZERO_FLAT if (stage != 0 or mixed) else Layout.REPLICATED}
    devices = (_offload_device(zero, "offload_optimizer"), _offload_device(zero, "offload_param"))
    if "cpu" in devices:
        layouts.add(Layout.CPU_RESIDENT)
    return frozenset(layouts)


def validate_deepspeed_config(
    config: Mapping[str, Any] | str | os.PathLike[str],
    optimizer: Any = None,
    *,
    fix: bool = False,
) -> dict[str, Any]:
    """Check a DeepSpeed config (and the client optimizer) for Gefen, before ``initialize``.

    Args:
        config: the DeepSpeed config dict or the path of its JSON file. Not modified.
        optimizer: the client optimizer instance (or class) to check against the config's
            layouts, or ``None`` to check the config alone.
        fix: add the missing keys of :func:`zero_config_keys` instead of raising for them
            (a key set to the wrong value is still an error: it was chosen by someone).

    Returns:
        A validated deep copy of the config (with the required keys when ``fix=True``).

    Raises:
        DeepSpeedConfigError: every problem found, in one message naming the key and the fix:
            an ``optimizer`` section (DeepSpeed would build its own optimizer and never call
            Gefen); ``zero_optimization.stage`` not an int in 0..3; a missing or false
            ``zero_allow_untested_optimizer`` at stages 1-3; CPU offload without
            ``zero_force_ds_cpu_optimizer: false``; ``offload_param`` below stage 3;
            ``offload_optimizer`` below stage 1; ``elastic_checkpoint``; NVMe offload
            (DeepSpeed swaps state with its own optimizers only: not supported for Gefen).
        gefen_dist.capabilities.UnsupportedCombinationError: ``optimizer`` is of the Muon family
            (or any class without ZeRO support) and the config flattens parameters; the message
            names the alternatives.
    """
    cfg = _load(config)
    problems: list[str] = []
    if cfg.get("optimizer") is not None:
        problems.append(
            "remove the 'optimizer' section: with it DeepSpeed builds its own optimizer and "
            "the Gefen instance passed to initialize() would never step"
        )
    zero = cfg.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise DeepSpeedConfigError(f"zero_optimization must be a dict, got {zero!r}")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise DeepSpeedConfigError(
            f"zero_optimization.stage must be an int in 0..3, got {stage!r}"
        )
    off_opt = _offload_device(zero, "offload_optimizer")
    off_par = _offload_device(zero, "offload_param")
    if "nvme" in (off_opt, off_par):
        problems.append(
            "NVMe offload is not supported for Gefen (DeepSpeed's NVMe swapper pages the state "
            "of its own optimizers only); use device 'cpu'"
        )
    if off_opt != "none" and stage == 0:
        problems.append("zero_optimization.offload_optimizer needs stage >= 1; raise the stage "
                        "or remove offload_optimizer")
    if off_par != "none" and stage != 3:
        problems.append(f"zero_optimization.offload_param needs stage 3 (got stage {stage}); "
                        "use stage 3 or remove offload_param")
    if zero.get("elastic_checkpoint"):
        problems.append("zero_optimization.elastic_checkpoint must be false: the elastic format "
                        "saves the raw per-partition state without Gefen's codebook and strips "
                        "padding from its [blocks, period] code tensors")
    offload = "cpu" in (off_opt, off_par)
    for key, want in zero_config_keys(offload=offload).items():
        if key == "zero_allow_untested_optimizer" and stage == 0:
            continue
        have = cfg.get(key, None)
        if have is None and fix:
            cfg[key] = want
        elif have is None:
            why = ("DeepSpeed refuses optimizers it does not know at stages 1-3"
                   if key == "zero_allow_untested_optimizer" else
                   "with CPU offload DeepSpeed otherwise refuses a client optimizer (or a "
                   "launcher swaps in its own CPU Adam)")
            problems.append(f'add "{key}": {json.dumps(want)} ({why}); '
                            "gefen_dist.deepspeed.zero_config_keys() lists the keys")
        elif have is not want and have != want:
            problems.append(f'"{key}" must be {json.dumps(want)}, got {have!r}')
    if problems:
        raise DeepSpeedConfigError(
            "DeepSpeed config is not usable with Gefen as the client optimizer:\n  - "
            + "\n  - ".join(problems)
        )
    if optimizer is not None:
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        for layout in sorted(zero_layouts(cfg), key=lambda x: x.value):
            try:
                if _is_muon_family(cls):
                    # The Muon family's own declaration, looked up explicitly: GefenMuon
                    # subclasses Gefen, so a registry gap would let it inherit ZERO_FLAT.
                    caps = GEFEN_MUON_CAPABILITIES
                    if layout not in caps.layouts:
                        raise UnsupportedCombinationError(
                            f"layout {layout.value!r} is not supported; "
                            f"{caps.hints.get(layout, '')}")
                else:
                    check_capabilities(optimizer, layout=layout)
            except UnsupportedCombinationError as exc:
                raise UnsupportedCombinationError(
                    f"{cls.__qualname__} cannot be a DeepSpeed client optimizer with this config "
                    f"(ZeRO stage {stage}, offload_optimizer={off_opt}, offload_param={off_par}): "
                    f"{exc}. Alternatives: gefen_core.Gefen as the ZeRO client optimizer; or "
                    "GefenMuon / GefenMuonHybrid with FSDP2 (fully_shard) or DDP instead of ZeRO"
                ) from exc
    return cfg


def _is_muon_family(cls: type) -> bool:
    from gefen_core.hybrid import GefenMuonHybrid
    from gefen_core.muon import GefenMuon

    return issubclass(cls, (GefenMuon, GefenMuonHybrid))


def initialize(
    *,
    model: Any,
    optimizer: Any,
    config: Mapping[str, Any] | str | os.PathLike[str],
    fix_config: bool = False,
    **kwargs: Any,
) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` with Gefen as the client optimizer, checked first.

    Args:
        model: the ``nn.Module``.
        optimizer: a ``gefen_core.Gefen`` built over ``model``'s parameters (the Muon family is
            refused; see :func:`validate_deepspeed_config`).
        config: DeepSpeed config dict or JSON path.
        fix_config: add the keys of :func:`zero_config_keys` when missing.
        **kwargs: passed to ``deepspeed.initialize`` (``lr_scheduler``, ``training_data``, ...).

    Returns:
        ``deepspeed.initialize``'s ``(engine, optimizer, dataloader, lr_scheduler)``.

    Raises:
        DeepSpeedConfigError, UnsupportedCombinationError: as
            :func:`validate_deepspeed_config`, before DeepSpeed is imported or the model touched.
        TypeError: ``optimizer`` is not an instantiated ``torch.optim.Optimizer`` (DeepSpeed's
            callable form would bypass the checks; build the optimizer first).
    """
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer must be an instantiated torch.optim.Optimizer such as "
            f"gefen_core.Gefen(model.parameters()), got {type(optimizer).__name__}"
        )
    for bad in ("config_params", "model_parameters"):
        if kwargs.get(bad) is not None:
            raise TypeError(f"{bad}= is not accepted here: pass config=, and build the optimizer "
                            "over model.parameters() yourself")
    cfg = validate_deepspeed_config(config, optimizer, fix=fix_config)
    import deepspeed

    out = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, **kwargs)
    track_zero_partitions(optimizer)
    return out


def name_zero_partitions(optimizer: Any) -> int:
    """Give the flat partitions ZeRO put into ``optimizer.param_groups`` names of their own.

    ZeRO (and DeepSpeed's fp16/bf16 wrappers) replace each group's ``params`` with flat fp32
    partitions after Gefen was built — ZeRO-1/2 once, ZeRO-3 around every ``step``,
    ``state_dict`` and ``load_state_dict`` (and an empty list in between) — but Gefen's parallel
    ``param_names`` still lists the original parameters; its ``state_dict`` would then carry a
    name list of the wrong length, which ``load_state_dict`` rightly refuses
    (docs/algorithm.md#checkpoint-format). This renames the tensors of every such group
    ``zero_partition.g<group>.<index>`` (flagged synthesized, docs/algorithm.md#overview) — the same
    on every rank, so checkpoints agree — and leaves groups whose lengths already agree alone.

    Returns:
        The number of groups renamed.
    """
    renamed = 0
    for i, group in enumerate(getattr(optimizer, "param_groups", [])):
        names = group.get("param_names")
        if names is None or "param_names_synthesized" not in group:
            continue  # not a Gefen group
        if len(names) == len(group["params"]):
            continue
        count = len(group["params"])
        group["param_names"] = [f"zero_partition.g{i}.{j}" for j in range(count)]
        group["param_names_synthesized"] = [True] * count
        renamed += 1
    return renamed


def track_zero_partitions(optimizer: Any) -> None:
    """Keep :func:`name_zero_partitions` applied whenever ZeRO swaps the partitions in.

    Registers it as a ``state_dict``, ``load_state_dict`` and ``step`` pre-hook of the Gefen
    instance (the public ``torch.optim.Optimizer`` hook API), once per optimizer.
    :func:`initialize` calls it; call it yourself after a bare ``deepspeed.initialize``.
    """
    if getattr(optimizer, "_gefen_zero_tracked", False):
        return

    def hook(opt: Any, *_: Any) -> None:
        name_zero_partitions(opt)

    optimizer.register_state_dict_pre_hook(hook)
    optimizer.register_load_state_dict_pre_hook(hook)
    optimizer.register_step_pre_hook(hook)
    optimizer._gefen_zero_tracked = True
