"""Gefen inside Megatron-Core's optimizer wrappers (docs/algorithm.md#distributed).

:func:`get_gefen_megatron_optimizer` is the Gefen counterpart of
``megatron.core.optimizer.get_megatron_optimizer``: it takes the same
``OptimizerConfig`` and model chunks and returns a ``MegatronOptimizer`` that Megatron's training
loop (``get_forward_backward_func`` + ``optimizer.step()`` + ``OptimizerParamScheduler``) drives
unchanged — gradient clipping, the grad-norm and zero-count statistics, bf16 fp32 main weights
and the legacy ``torch`` checkpoint format (``optimizer.state_dict()`` per rank) are Megatron's.
Three recipes (docs/algorithm.md#distributed):

* ``"gefen"``: plain :class:`gefen_core.Gefen` on every parameter;
* ``"muon_adamw"``: :class:`gefen_core.muon.GefenMuon` on the hidden 2-D matrices,
  ``torch.optim.AdamW`` on the rest (embeddings, output layer, norms, biases);
* ``"muon_gefen"``: the same with a Gefen backup at ``backup_lr`` (default ``0.5 x lr``).

The Muon recipes are two wrapped optimizers in a ``ChainedOptimizer`` (as Megatron's own Muon
does), so Megatron computes one grad norm over both halves and clips them together. Routing is
:func:`gefen_core.routing.split_params_for_muon` with Megatron's ``output_layer`` added to the
backup words (a Megatron output layer is a ``ColumnParallelLinear``, not an embedding).

What the config may ask for. Taken from ``OptimizerConfig``: ``lr``, ``min_lr``,
``weight_decay``, ``adam_beta1/2``, ``adam_eps``, ``clip_grad``, ``bf16``. Refused with
:class:`MegatronConfigError` (not exercised, docs/algorithm.md#distributed): ``fp16``,
``use_distributed_optimizer``, ``optimizer_cpu_offload``, ``use_precision_aware_optimizer``,
Megatron-FSDP; and for the Muon recipes tensor parallelism > 1 (GefenMuon orthogonalises whole
matrices; a TP shard is not one). ``config.optimizer`` is ignored: the recipe chooses the optimizer.

Megatron's forward needs CUDA, and so do its optimizer wrappers; :func:`check_megatron_config`
and :func:`build_gefen_optimizers` (the unwrapped torch optimizers) work on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gefen_core import Gefen

__all__ = [
    "MEGATRON_BACKUP_SUBSTRINGS",
    "RECIPES",
    "MegatronConfigError",
    "build_gefen_optimizers",
    "check_megatron_config",
    "get_gefen_megatron_optimizer",
]

RECIPES = ("gefen", "muon_adamw", "muon_gefen")


def _backup_words() -> tuple[str, ...]:
    from gefen_core.routing import DEFAULT_BACKUP_SUBSTRINGS

    return tuple(DEFAULT_BACKUP_SUBSTRINGS) + ("output_layer",)


#: Name fragments routed to the backup optimizer under Megatron: the defaults of
#: docs/algorithm.md#hybrid plus ``output_layer`` (Megatron's untied LM head).
MEGATRON_BACKUP_SUBSTRINGS: tuple[str, ...] = _backup_words()


class MegatronConfigError(ValueError):
    """An ``OptimizerConfig`` / parallel layout that the Gefen integration does not support."""


def _get(config: Any, name: str, default: Any = None) -> Any:
    return getattr(config, name, default)


def check_megatron_config(
    config: Any,
    recipe: str = "gefen",
    *,
    tensor_model_parallel_size: int | None = None,
) -> None:
    """Validate a Megatron ``OptimizerConfig`` for ``recipe`` before anything is built.

    Args:
        config: ``megatron.core.optimizer.OptimizerConfig``.
        recipe: one of :data:`RECIPES`.
        tensor_model_parallel_size: TP size; ``None`` reads it from ``megatron.core
            .parallel_state`` when model parallelism is initialised, else assumes 1.

    Raises:
        TypeError: ``config`` is not an ``OptimizerConfig``.
        MegatronConfigError: every unsupported setting in one message, each with its fix.
    """
    from megatron.core.optimizer import OptimizerConfig

    if not isinstance(config, OptimizerConfig):
        raise TypeError("config must be a megatron.core.optimizer.OptimizerConfig, got "
                        f"{type(config).__name__}")
    problems = []
    if recipe not in RECIPES:
        problems.append(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if _get(config, "fp16"):
        problems.append("fp16=True is not supported (dynamic loss scaling with Gefen is not "
                        "exercised under Megatron); use bf16=True")
    if _get(config, "use_distributed_optimizer"):
        problems.append("use_distributed_optimizer=True is not supported: Megatron's distributed "
                        "optimizer shards flat buffers and saves Adam-shaped state; set it to "
                        "False (Megatron DDP with the legacy torch checkpoint format)")
    if _get(config, "optimizer_cpu_offload"):
        problems.append("optimizer_cpu_offload=True is not supported (Megatron builds its own "
                        "CPU Adam); set it to False")
    if _get(config, "use_precision_aware_optimizer"):
        problems.append("use_precision_aware_optimizer=True is a Transformer Engine Adam "
                        "feature; set it to False")
    lr = _get(config, "lr")
    if lr is None or not (isinstance(lr, (int, float)) and lr >= 0):
        problems.append(f"lr must be a float >= 0, got {lr!r}")
    if recipe.startswith("muon"):
        tp = tensor_model_parallel_size
        if tp is None:
            tp = 1
            try:
                from megatron.core import parallel_state

                if parallel_state.model_parallel_is_initialized():
                    tp = parallel_state.get_tensor_model_parallel_world_size()
            except (ImportError, AssertionError, RuntimeError):
                tp = 1
        if tp != 1:
            problems.append(f"recipe {recipe!r} needs tensor_model_parallel_size=1 (got {tp}): "
                            "GefenMuon orthogonalises whole matrices and a TP shard is not one; "
                            "use recipe 'gefen' with TP > 1")
    if problems:
        raise MegatronConfigError("Megatron optimizer config is not usable with Gefen:\n  - "
                                  + "\n  - ".join(problems))


def _named(model_chunks: Sequence[nn.Module] | nn.Module) -> list[tuple[str, torch.Tensor]]:
    if isinstance(model_chunks, nn.Module):
        model_chunks = [model_chunks]
    if not model_chunks or not all(isinstance(m, nn.Module) for m in model_chunks):
        raise TypeError("model_chunks must be a non-empty list of nn.Module (Megatron's model "
                        "chunks, e.g. [DistributedDataParallel(GPTModel(...))])")
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for i, chunk in enumerate(model_chunks):
        prefix = f"chunk{i}." if len(model_chunks) > 1 else ""
        for name, p in chunk.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((prefix + name.removeprefix("module."), p))
    if not out:
        raise ValueError("model_chunks hold no trainable parameters")
    return out


def _no_decay(name: str, p: torch.Tensor) -> bool:
    # Megatron's default rule: no weight decay on biases and 1-D (norm) parameters.
    return p.ndim == 1 or name.endswith(".bias")


def _groups(named: list[tuple[str, torch.Tensor]], lr: float, min_lr: float,
            weight_decay: float, default_config: bool) -> list[dict[str, Any]]:
    groups = []
    for no_wd in (False, True):
        items = [(n, p) for n, p in named if _no_decay(n, p) == no_wd]
        if not items:
            continue
        groups.append({
            "params": [p for _, p in items], "param_names": [n for n, _ in items],
            "lr": lr, "weight_decay": 0.0 if no_wd else weight_decay,
            # OptimizerParamScheduler rewrites lr and weight_decay every step from these.
            "max_lr": lr, "min_lr": min_lr, "wd_mult": 0.0 if no_wd else 1.0,
            "lr_mult": 1.0, "default_config": default_config, "is_expert_parallel": False,
            "is_decoupled_lr": False,
        })
    return groups


def build_gefen_optimizers(
    config: Any,
    model_chunks: Sequence[nn.Module] | nn.Module,
    recipe: str = "gefen",
    *,
    backup_lr: float | None = None,
    gefen_kwargs: dict[str, Any] | None = None,
    muon_kwargs: dict[str, Any] | None = None,
) -> list[torch.optim.Optimizer]:
    """The torch optimizers of ``recipe`` over ``model_chunks``' trainable parameters.

    Args:
        config: ``OptimizerConfig`` (checked with :func:`check_megatron_config`).
        model_chunks: the model chunks (or one module).
        recipe: ``"gefen"``, ``"muon_adamw"`` or ``"muon_gefen"``.
        backup_lr: the backup half's peak lr; default ``config.lr`` for AdamW and
            ``0.5 * config.lr`` for Gefen (docs/algorithm.md#distributed lowest-memory recipe).
            ``min_lr`` scales with it.
        gefen_kwargs: extra ``Gefen`` arguments (plain recipe and Gefen backup), e.g.
            ``{"fused": True, "deterministic": True}``.
        muon_kwargs: extra ``GefenMuon`` arguments (e.g. ``ns_schedule``, ``normuon``).

    Returns:
        ``[Gefen]`` or ``[GefenMuon, backup]``; every group carries Megatron's scheduler keys
        (``max_lr``, ``min_lr``, ``wd_mult``, ``lr_mult``, ``default_config``) and
        ``param_names``. Biases and 1-D parameters get no weight decay (Megatron's rule).

    Raises:
        TypeError, MegatronConfigError: as :func:`check_megatron_config`; bad ``model_chunks``.
        ValueError: no trainable parameters; a Muon recipe with no 2-D hidden matrix.
    """
    check_megatron_config(config, recipe)
    named = _named(model_chunks)
    lr = float(config.lr)
    min_lr = float(_get(config, "min_lr", 0.0) or 0.0)
    wd = float(_get(config, "weight_decay", 0.0) or 0.0)
    betas = (float(config.adam_beta1), float(config.adam_beta2))
    eps = float(config.adam_eps)
    gkw = dict(gefen_kwargs or {})
    if recipe == "gefen":
        return [Gefen(_groups(named, lr, min_lr, wd, True), lr=lr, betas=betas, eps=eps,
                      weight_decay=wd, **gkw)]
    from gefen_core.muon import GefenMuon
    from gefen_core.routing import split_params_for_muon

    muon_named, backup_named = split_params_for_muon(
        named, backup_substrings=MEGATRON_BACKUP_SUBSTRINGS)
    if not muon_named:
        raise ValueError(f"recipe {recipe!r}: no hidden 2-D matrix to give GefenMuon (every "
                         "parameter was routed to the backup); use recipe 'gefen'")
    mkw = {"adjust_lr_fn": "match_rms_adamw", "ns_schedule": "tuned3", "normuon": True,
           "nesterov": True, "momentum": 0.95, **(muon_kwargs or {})}
    for key in ("fused", "deterministic"):
        if key in gkw:
            mkw.setdefault(key, gkw[key])
    muon = GefenMuon(_groups(muon_named, lr, min_lr, wd, True), lr=lr, weight_decay=wd, **mkw)
    if not backup_named:
        return [muon]
    adamw = recipe == "muon_adamw"
    blr = float(backup_lr) if backup_lr is not None else (lr if adamw else 0.5 * lr)
    bmin = min_lr * (blr / lr) if lr > 0 else 0.0
    groups = _groups(backup_named, blr, bmin, wd, False)
    if adamw:
        for g in groups:
            g.pop("param_names")
        backup: torch.optim.Optimizer = torch.optim.AdamW(
            groups, lr=blr, betas=betas, eps=eps, weight_decay=wd)
    else:
        backup = Gefen(groups, lr=blr, betas=betas, eps=eps, weight_decay=wd,
                       factored_v_2d=False, **gkw)
    return [muon, backup]


def get_gefen_megatron_optimizer(
    config: Any,
    model_chunks: Sequence[nn.Module] | nn.Module,
    recipe: str = "gefen",
    **kwargs: Any,
) -> Any:
    """A ``MegatronOptimizer`` running ``recipe`` — use it where Megatron's training loop uses
    ``get_megatron_optimizer(config, model_chunks)``.

    Each torch optimizer of :func:`build_gefen_optimizers` is wrapped like Megatron wraps its
    Adam: ``FP32Optimizer`` (fp32) or ``Float16OptimizerWithFloat16Params`` (``bf16``: fp32
    main weights, no loss scaler); two are combined with ``ChainedOptimizer``. Needs CUDA
    parameters (Megatron's wrappers do).

    Args:
        config, model_chunks, recipe, **kwargs: as :func:`build_gefen_optimizers`.

    Returns:
        ``megatron.core.optimizer.MegatronOptimizer``.

    Raises:
        As :func:`build_gefen_optimizers`.
    """
    from megatron.core import parallel_state
    from megatron.core.optimizer.optimizer import (
        ChainedOptimizer,
        Float16OptimizerWithFloat16Params,
        FP32Optimizer,
    )

    optimizers = build_gefen_optimizers(config, model_chunks, recipe, **kwargs)
    wrapped = []
    mp_group = parallel_state.get_model_parallel_group() \
        if parallel_state.model_parallel_is_initialized() else None
    tp_group = parallel_state.get_tensor_model_parallel_group() \
        if parallel_state.model_parallel_is_initialized() else None
    for opt in optimizers:
        if config.bf16:
            w = Float16OptimizerWithFloat16Params(opt, config, None, None)
        else:
            w = FP32Optimizer(opt, config, None)
        w.grad_stats_parallel_group = mp_group
        w.tp_group = tp_group
        wrapped.append(w)
    return wrapped[0] if len(wrapped) == 1 else ChainedOptimizer(wrapped)
