"""The optimizers gefen-bench compares, by name.

Each entry builds a *list* of ``torch.optim.Optimizer`` objects for a list of named
parameters (a peer such as Muon + AdamW is two optimizers stepped together); the trainers
step, schedule and zero every optimizer in the list. An entry whose package is missing is
*skipped* with a reason, never a crash: :func:`availability` says why.

The published ``gefen-x`` 0.5.0 and ``gefen`` 1.2.3 both import as ``gefen``, as does this
project's facade, so they run only in their own worker process, loaded from a directory the
user installed them into (``--target gefen-x=DIR``), see :func:`load_external_gefen`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

NamedParams = Sequence[tuple[str, torch.Tensor]]
NamedList = list[tuple[str, torch.Tensor]]
Builder = Callable[..., list[torch.optim.Optimizer]]

# Name fragments that route a 2-D parameter away from Muon (docs/algorithm.md#hybrid rule 4).
_MUON_EXCLUDED_NAMES = ("embed", "wte", "wpe", "lm_head", "classifier", "score")

# Gefen's default learning rate as a multiple of AdamW's (the registry's lr_scale of "gefen"):
# an untuned comparison gives Gefen AdamW's LR; a sweep on the task may find another
# (gefen-bench train tunes every optimizer on one shared grid).
GEFEN_LR_RATIO = 1.0

# Published packages that import as ``gefen``: --target key -> version prefix it must have.
EXTERNAL_PACKAGES = {"gefen-x": "0.5.", "gefen": "1.2."}


class UnknownOptimizerError(ValueError):
    """An optimizer name that is not in the registry; the message lists the known names."""


@dataclass(frozen=True)
class OptimizerSpec:
    """One comparable optimizer.

    Attributes:
        name: the CLI name (``--optimizers gefen,adamw``).
        summary: one line for tables and ``--help``.
        lr_scale: default learning rate as a multiple of the task's AdamW learning rate.
        build: ``build(named_params, *, lr, weight_decay, device, model) -> [Optimizer, ...]``.
        requires: what must be installed (shown when skipped).
        external: ``--target`` key for published packages run in their own process.
        min_bytes_per_param: the least bytes per parameter one bf16 step must move (the
            bandwidth roofline of ``gefen-bench step``; see docs/benchmarks.md).
        options: optimizer keyword arguments recorded in reports.
        graph: ``gefen-bench step`` captures the steady step in a CUDA graph and times its
            replays (the optimizer is built with ``capturable=True``); only that command on a
            CUDA device runs it (:func:`availability`).
        compiled: ``gefen-bench step`` times the step through ``torch.compile`` (default mode)
            after an eager first step, the recipe of docs/compile.md; only that command runs
            it (:func:`availability`).
        steps_in_backward: the optimizers ``build`` returns update each parameter during
            ``loss.backward()`` (:func:`gefen_core.step_in_backward`, from gradient hooks the
            builder registers on the model, ``model=``) and free its gradient there. The
            trainers still call ``opt.step()`` (:func:`step`), which finishes the step, but
            clip no gradients by their global norm (none exists before the first update), and
            ``gefen-bench fit`` counts only the gradients still alive after backward.
            ``gefen-bench step`` and ``memory``, which step without a backward pass, skip
            such an entry (:func:`availability`).
    """

    name: str
    summary: str
    lr_scale: float
    build: Builder
    requires: str = ""
    external: str | None = None
    min_bytes_per_param: float = 14.0
    options: dict[str, object] = field(default_factory=dict)
    graph: bool = False
    compiled: bool = False
    steps_in_backward: bool = False


def split_for_muon(
    named: NamedParams, model: nn.Module | None = None
) -> tuple[NamedList, NamedList]:
    """(hidden 2-D matrices, everything else): the routing of docs/algorithm.md#hybrid.

    Embedding weights (by identity when ``model`` is given, else by name), the LM head,
    non-2-D tensors (biases, norms, convolution kernels) go to the second list.
    """
    embedding_ids: set[int] = set()
    if model is not None:
        for module in model.modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                embedding_ids.add(id(module.weight))
    muon: NamedList = []
    rest: NamedList = []
    for name, p in named:
        lowered = name.lower()
        if (
            p.ndim != 2
            or id(p) in embedding_ids
            or any(s in lowered for s in _MUON_EXCLUDED_NAMES)
        ):
            rest.append((name, p))
        else:
            muon.append((name, p))
    return muon, rest


def _adamw_impl(device: torch.device) -> dict[str, bool]:
    # torch ships a fused AdamW for CUDA and CPU; foreach is the fallback elsewhere.
    if device.type in ("cuda", "cpu"):
        return {"fused": True}
    return {"foreach": True}


def _build_adamw(named: NamedParams, *, lr: float, weight_decay: float, device: torch.device,
                 model: nn.Module | None = None, impl: dict[str, bool] | None = None,
                 ) -> list[torch.optim.Optimizer]:
    kw: dict[str, Any] = dict(_adamw_impl(device) if impl is None else impl)
    return [torch.optim.AdamW([p for _, p in named], lr=lr, weight_decay=weight_decay, **kw)]


class AdamWFP32State(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) whose ``exp_avg`` and
    ``exp_avg_sq`` are float32 whatever the parameters' dtype: the "fp32 state" AdamW of
    mixed-precision training without a float32 master copy. Each step computes in float32
    and writes the parameter back in its own dtype (round to nearest).

    State per parameter: ``step`` (float32 scalar tensor), ``exp_avg`` and ``exp_avg_sq``
    (float32, the parameter's shape): 8 bytes per parameter element.

    Raises:
        ValueError: ``lr``, ``eps`` or ``weight_decay`` negative, or a beta outside [0, 1).
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got lr={lr}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = float(state["step"])
                grad = p.grad.float()
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt_().add_(eps)
                update = state["exp_avg"] / denom
                value = p.float().mul_(1 - lr * wd).add_(update, alpha=-lr / (1 - beta1 ** t))
                p.copy_(value)
        return loss


def _build_adamw_fp32_state(named: NamedParams, *, lr: float, weight_decay: float,
                            device: torch.device, model: nn.Module | None = None,
                            ) -> list[torch.optim.Optimizer]:
    return [AdamWFP32State([p for _, p in named], lr=lr, weight_decay=weight_decay)]


def _gefen_class(name: str) -> type:
    module = importlib.import_module("gefen_core")
    cls: type = getattr(module, name)
    return cls


def _build_gefen(named: NamedParams, *, lr: float, weight_decay: float, device: torch.device,
                 model: nn.Module | None = None, **options: object,
                 ) -> list[torch.optim.Optimizer]:
    gefen = _gefen_class("Gefen")
    return [gefen(named, lr=lr, weight_decay=weight_decay, **options)]


def _build_gefen_in_backward(named: NamedParams, *, lr: float, weight_decay: float,
                             device: torch.device, model: nn.Module | None = None,
                             **options: object) -> list[torch.optim.Optimizer]:
    core = importlib.import_module("gefen_core")
    opt = core.Gefen(named, lr=lr, weight_decay=weight_decay, **options)
    # The hooks keep the handle alive; `opt.step()` in the loop completes each step.
    core.step_in_backward(model if model is not None else [p for _, p in named], opt)
    return [opt]


def _build_adafactor(named: NamedParams, *, lr: float, weight_decay: float,
                     device: torch.device, model: nn.Module | None = None,
                     ) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adafactor([p for _, p in named], lr=lr, weight_decay=weight_decay)]


def _build_torch_muon(named: NamedParams, *, lr: float, weight_decay: float,
                      device: torch.device, model: nn.Module | None = None,
                      ) -> list[torch.optim.Optimizer]:
    muon_named, rest = split_for_muon(named, model)
    opts: list[torch.optim.Optimizer] = []
    if muon_named:
        # match_rms_adamw lets Muon share AdamW's learning rate (torch.optim.Muon docs).
        opts.append(torch.optim.Muon([p for _, p in muon_named], lr=lr,
                                     weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"))
    if rest:
        opts.extend(_build_adamw(rest, lr=lr, weight_decay=weight_decay, device=device))
    return opts


def _build_hybrid(named: NamedParams, *, lr: float, weight_decay: float, device: torch.device,
                  model: nn.Module | None = None, **options: object,
                  ) -> list[torch.optim.Optimizer]:
    hybrid = _gefen_class("GefenMuonHybrid")
    # The hybrid's own routing (docs/algorithm.md#hybrid forms 2 and 3) is part of what is measured.
    source: object = model if model is not None else named
    return [hybrid(source, lr=lr, weight_decay=weight_decay, **options)]


def _build_torchao(cls_name: str) -> Builder:
    def build(named: NamedParams, *, lr: float, weight_decay: float, device: torch.device,
              model: nn.Module | None = None) -> list[torch.optim.Optimizer]:
        cls = getattr(importlib.import_module("torchao.optim"), cls_name)
        return [cls([p for _, p in named], lr=lr, weight_decay=weight_decay)]
    return build


def _build_bnb(named: NamedParams, *, lr: float, weight_decay: float, device: torch.device,
               model: nn.Module | None = None) -> list[torch.optim.Optimizer]:
    bnb_optim = importlib.import_module("bitsandbytes.optim")
    return [bnb_optim.AdamW8bit([p for _, p in named], lr=lr, weight_decay=weight_decay)]


def _build_external(named: NamedParams, *, lr: float, weight_decay: float,
                    device: torch.device, model: nn.Module | None = None, **options: object,
                    ) -> list[torch.optim.Optimizer]:
    # load_external_gefen() has put the published package in sys.modules["gefen"].
    gefen = sys.modules.get("gefen")
    if gefen is None:
        raise RuntimeError("the published gefen package was not loaded in this worker")
    fused = device.type == "cuda"
    return [gefen.Gefen(named, lr=lr, weight_decay=weight_decay, fused=fused, **options)]


REGISTRY: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in [
        OptimizerSpec("adamw", "torch.optim.AdamW (fused where torch has it, else foreach)",
                      1.0, _build_adamw, min_bytes_per_param=14.0),
        # torch.optim.AdamW keeps its moments in the parameters' dtype (bf16 parameters:
        # bf16 state); this entry keeps them in float32 over the same parameters.
        OptimizerSpec("adamw-fp32-state",
                      "AdamW with float32 exp_avg/exp_avg_sq over any parameter dtype", 1.0,
                      _build_adamw_fp32_state, min_bytes_per_param=20.0),
        OptimizerSpec("adamw-default", "torch.optim.AdamW with torch's default implementation",
                      1.0, lambda n, **kw: _build_adamw(n, impl={}, **kw),
                      min_bytes_per_param=14.0),
        OptimizerSpec("adamw-fused", "torch.optim.AdamW(fused=True)", 1.0,
                      lambda n, **kw: _build_adamw(n, impl={"fused": True}, **kw),
                      min_bytes_per_param=14.0, options={"fused": True}),
        OptimizerSpec("adamw-foreach", "torch.optim.AdamW(foreach=True)", 1.0,
                      lambda n, **kw: _build_adamw(n, impl={"foreach": True}, **kw),
                      min_bytes_per_param=14.0, options={"foreach": True}),
        OptimizerSpec("gefen", "gefen_core.Gefen, defaults (factored second moment)",
                      GEFEN_LR_RATIO,
                      _build_gefen, requires="gefen-core", min_bytes_per_param=8.0),
        OptimizerSpec("gefen-blockv", "gefen_core.Gefen(factored_v_2d=False)", GEFEN_LR_RATIO,
                      lambda n, **kw: _build_gefen(n, factored_v_2d=False, **kw),
                      requires="gefen-core", min_bytes_per_param=8.0,
                      options={"factored_v_2d": False}),
        # The factoring rule off (docs/algorithm.md#factoring-rule): every matrix factored,
        # as before the rule, to measure what the rule changes on small models.
        OptimizerSpec("gefen-factor-all", "gefen_core.Gefen(min_dim_size_to_factor=0)",
                      GEFEN_LR_RATIO,
                      lambda n, **kw: _build_gefen(n, min_dim_size_to_factor=0, **kw),
                      requires="gefen-core", min_bytes_per_param=8.0,
                      options={"min_dim_size_to_factor": 0}),
        OptimizerSpec("gefen-in-backward",
                      "gefen_core.Gefen stepped in backward (step_in_backward), gradients "
                      "released as each parameter steps", GEFEN_LR_RATIO,
                      _build_gefen_in_backward, requires="gefen-core with step_in_backward",
                      min_bytes_per_param=8.0, steps_in_backward=True),
        # Launch-bound sets (GPT-2's 148 tensors) without host launch cost: the steady step is
        # captured once and replayed (torch's CUDA-graph recipe; lr is a float, baked in).
        OptimizerSpec("gefen-graph", "gefen_core.Gefen(capturable=True), step in a CUDA graph",
                      GEFEN_LR_RATIO, lambda n, **kw: _build_gefen(n, capturable=True, **kw),
                      requires="gefen-core and a CUDA device", min_bytes_per_param=8.0,
                      options={"capturable": True}, graph=True),
        OptimizerSpec("gefen-blockv-graph",
                      "gefen_core.Gefen(factored_v_2d=False, capturable=True), step in a CUDA "
                      "graph", GEFEN_LR_RATIO,
                      lambda n, **kw: _build_gefen(n, factored_v_2d=False, capturable=True,
                                                   **kw),
                      requires="gefen-core and a CUDA device", min_bytes_per_param=8.0,
                      options={"factored_v_2d": False, "capturable": True}, graph=True),
        OptimizerSpec("adamw-fused-graph",
                      "torch.optim.AdamW(fused=True, capturable=True), step in a CUDA graph",
                      1.0,
                      lambda n, **kw: _build_adamw(n, impl={"fused": True, "capturable": True},
                                                   **kw),
                      requires="a CUDA device", min_bytes_per_param=14.0,
                      options={"fused": True, "capturable": True}, graph=True),
        # The same optimizers with the step compiled (torch.compile, default mode): the steady
        # step is one graph of opaque Gefen ops (docs/compile.md), timed next to the eager rows.
        OptimizerSpec("gefen-compiled", "gefen_core.Gefen, step compiled with torch.compile",
                      GEFEN_LR_RATIO, _build_gefen, requires="gefen-core",
                      min_bytes_per_param=8.0, compiled=True),
        OptimizerSpec("gefen-blockv-compiled",
                      "gefen_core.Gefen(factored_v_2d=False), step compiled with torch.compile",
                      0.6, lambda n, **kw: _build_gefen(n, factored_v_2d=False, **kw),
                      requires="gefen-core", min_bytes_per_param=8.0,
                      options={"factored_v_2d": False}, compiled=True),
        OptimizerSpec("gefen-muon-hybrid-compiled",
                      "gefen_core.GefenMuonHybrid (Gefen backup), step compiled with "
                      "torch.compile", 1.0, _build_hybrid,
                      requires="gefen-core with GefenMuonHybrid", min_bytes_per_param=8.0,
                      compiled=True),
        OptimizerSpec("adamw-foreach-compiled",
                      "torch.optim.AdamW(foreach=True), step compiled with torch.compile", 1.0,
                      lambda n, **kw: _build_adamw(n, impl={"foreach": True}, **kw),
                      min_bytes_per_param=14.0, options={"foreach": True}, compiled=True),
        OptimizerSpec("adafactor", "torch.optim.Adafactor (relative step size)", 3.0,
                      _build_adafactor, requires="torch>=2.5 (torch.optim.Adafactor)",
                      min_bytes_per_param=6.0),
        OptimizerSpec("muon", "torch.optim.Muon on hidden 2-D matrices + AdamW on the rest",
                      1.0, _build_torch_muon, requires="torch>=2.9 (torch.optim.Muon)",
                      min_bytes_per_param=10.0),
        # The hybrids share one lr (docs/algorithm.md#hybrid) and their Muon half uses
        # adjust_lr_fn="match_rms_adamw", so they take the lr torch.optim.Muon gets in "muon"
        # (1 x AdamW's), as plain Gefen does. Measured on the LM task (held-out loss,
        # docs/results/cpu/lm-muon.json): at 0.6 x the AdamW-backup hybrid was 15% behind
        # "muon", at 1 x 0.9%; the Gefen-backup hybrid with its backup at 0.6 x lr was 2.4%
        # worse than with the shared lr.
        OptimizerSpec("gefen-muon-hybrid", "gefen_core.GefenMuonHybrid (Gefen backup)", 1.0,
                      _build_hybrid, requires="gefen-core with GefenMuonHybrid",
                      min_bytes_per_param=8.0),
        OptimizerSpec("gefen-muon-hybrid-adamw",
                      "gefen_core.GefenMuonHybrid(backup_optimizer='adamw')", 1.0,
                      lambda n, **kw: _build_hybrid(n, backup_optimizer="adamw", **kw),
                      requires="gefen-core with GefenMuonHybrid", min_bytes_per_param=8.0,
                      options={"backup_optimizer": "adamw"}),
        OptimizerSpec("torchao-adamw8bit", "torchao.optim.AdamW8bit", 1.0,
                      _build_torchao("AdamW8bit"), requires="gefen-bench[peers] (torchao)",
                      min_bytes_per_param=10.0),
        OptimizerSpec("torchao-adamw4bit", "torchao.optim.AdamW4bit", 1.0,
                      _build_torchao("AdamW4bit"), requires="gefen-bench[peers] (torchao)",
                      min_bytes_per_param=8.0),
        OptimizerSpec("bnb-adamw8bit", "bitsandbytes.optim.AdamW8bit", 1.0, _build_bnb,
                      requires="gefen-bench[peers] (bitsandbytes)", min_bytes_per_param=10.0),
        OptimizerSpec("gefenx-0.5", "published gefen-x 0.5.0 Gefen (own process)",
                      GEFEN_LR_RATIO,
                      _build_external, requires="--target gefen-x=DIR", external="gefen-x",
                      min_bytes_per_param=8.0),
        OptimizerSpec("gefenx-0.5-blockv", "published gefen-x 0.5.0 Gefen(factored_v_2d=False)",
                      GEFEN_LR_RATIO,
                      lambda n, **kw: _build_external(n, factored_v_2d=False, **kw),
                      requires="--target gefen-x=DIR", external="gefen-x",
                      min_bytes_per_param=8.0, options={"factored_v_2d": False}),
        OptimizerSpec("gefen-1.2", "published gefen 1.2.3 Gefen (own process)",
                      GEFEN_LR_RATIO,
                      _build_external, requires="--target gefen=DIR", external="gefen",
                      min_bytes_per_param=8.0),
    ]
}

# What `gefen-bench train` compares when --optimizers is not given (unavailable ones are
# reported as skipped).
TRAIN_DEFAULT = ("gefen", "adamw", "adafactor", "muon", "gefen-muon-hybrid-adamw",
                 "torchao-adamw8bit", "torchao-adamw4bit", "bnb-adamw8bit", "gefenx-0.5")


def get_spec(name: str) -> OptimizerSpec:
    """The registry entry for ``name``.

    Raises:
        UnknownOptimizerError: ``name`` is not registered; the message lists every name.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownOptimizerError(
            f"unknown optimizer {name!r}; available: {', '.join(REGISTRY)}"
        ) from None


def parse_names(text: str) -> list[str]:
    """Comma-separated optimizer names, validated (:class:`UnknownOptimizerError`)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UnknownOptimizerError(f"no optimizer named; available: {', '.join(REGISTRY)}")
    for n in names:
        get_spec(n)
    return names


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def external_version(target: str) -> str | None:
    """Version of the ``gefen-x`` or ``gefen`` distribution installed in ``target``, if any."""
    for dist in importlib.metadata.distributions(path=[target]):
        if dist.metadata["Name"] in EXTERNAL_PACKAGES:
            return dist.version
    return None


def availability(name: str, targets: dict[str, str] | None = None,
                 device: torch.device | None = None, *, plain_step: bool = False
                 ) -> str | None:
    """``None`` when ``name`` can run here, else the reason it is skipped (one line).

    ``device``: where ``gefen-bench step`` runs; CUDA-graph entries (``graph=True``) run only
    there, on a CUDA device, and compiled-step entries (``compiled=True``) only there (other
    commands pass no device and skip both). ``plain_step``: the command calls ``opt.step()``
    with no backward pass (``step``, ``memory``), which an entry that steps inside the
    backward pass (``steps_in_backward``) cannot do.
    """
    spec = get_spec(name)
    targets = targets or {}
    if spec.steps_in_backward and plain_step:
        return "steps inside the backward pass: this command steps with no backward pass"
    if spec.compiled and device is None:
        return "a compiled-step entry: only gefen-bench step compiles and times it"
    if spec.graph:
        if device is None:
            return "a CUDA-graph entry: only gefen-bench step captures and replays it"
        if device.type != "cuda":
            return f"CUDA graph capture needs a CUDA device, not {device.type}"
    if spec.external is not None:
        target = targets.get(spec.external)
        if target is None:
            return (f"not given: pip install --no-deps --target DIR "
                    f"'{spec.external}=={EXTERNAL_PACKAGES[spec.external]}*', then pass "
                    f"--target {spec.external}=DIR")
        if not (Path(target) / "gefen" / "__init__.py").is_file():
            return f"--target {spec.external}={target}: no gefen/__init__.py there"
        version = external_version(target)
        if version is None or not version.startswith(EXTERNAL_PACKAGES[spec.external]):
            return (f"--target {spec.external}={target} holds version {version}, "
                    f"not {EXTERNAL_PACKAGES[spec.external]}x")
        return None
    if name.startswith("gefen"):
        cls = ("GefenMuonHybrid" if "hybrid" in name
               else "step_in_backward" if spec.steps_in_backward else "Gefen")
        try:
            module = importlib.import_module("gefen_core")
        except ImportError as exc:
            return f"gefen_core does not import: {exc}"
        if not hasattr(module, cls):
            version = getattr(module, "__version__", "?")
            return f"gefen_core {version} has no {cls} yet"
        return None
    if name == "adafactor" and not hasattr(torch.optim, "Adafactor"):
        return f"torch {torch.__version__} has no torch.optim.Adafactor (needs torch>=2.5)"
    if name == "muon" and not hasattr(torch.optim, "Muon"):
        return f"torch {torch.__version__} has no torch.optim.Muon (needs torch>=2.9)"
    if name.startswith("torchao") and not _module_present("torchao"):
        return "torchao not installed (pip install 'gefen-bench[peers]')"
    if name.startswith("bnb") and not _module_present("bitsandbytes"):
        return "bitsandbytes not installed (pip install 'gefen-bench[peers]')"
    return None


def load_external_gefen(target: str) -> str:
    """Import the published ``gefen`` package from ``target`` as ``sys.modules['gefen']``.

    Only the ``gefen`` package directory is loaded from ``target`` (anything else there, such
    as a second torch, is ignored). Call it in a fresh worker process before building.

    Returns:
        The distribution version found in ``target``.
    """
    init = Path(target) / "gefen" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "gefen", init, submodule_search_locations=[str(init.parent)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the gefen package from {init}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gefen"] = module
    spec.loader.exec_module(module)
    return external_version(target) or "unknown"



def build(name: str, named: NamedParams, *, lr: float, weight_decay: float,
          device: torch.device, model: nn.Module | None = None) -> list[torch.optim.Optimizer]:
    """Build optimizer ``name`` over ``named`` parameters (see :class:`OptimizerSpec`)."""
    return get_spec(name).build(named, lr=lr, weight_decay=weight_decay, device=device,
                                model=model)
