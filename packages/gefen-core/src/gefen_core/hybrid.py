"""GefenMuonHybrid: one optimizer for a whole model (docs/algorithm.md#hybrid).

Hidden 2-D weight matrices get :class:`~gefen_core.muon.GefenMuon`; everything else
(embeddings, heads, norms, biases, convolution kernels, zero-size tensors) gets a backup
optimizer — :class:`~gefen_core.Gefen` (about 1 byte/param) or ``torch.optim.AdamW``. The two
children keep their own state and code paths; the hybrid makes them behave as one
``torch.optim.Optimizer``: one ``param_groups`` list (the children's live dicts, so LR
schedulers work), one routed ``state`` view, one AMP decision, one checkpoint that loads
all-or-nothing across both halves.
"""

from __future__ import annotations

import copy
import math
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from . import _compiled_step
from . import amp as _amp
from . import nonfinite as _nonfinite
from .muon import GefenMuon
from .newton_schulz import DEFAULT_NS_STEPS
from .optimizer import Gefen
from .routing import NamedParams, split_params_for_muon, validate_split

__all__ = ["HYBRID_FORMAT_VERSION", "GefenMuonHybrid"]

#: Version tag of the nested checkpoint (docs/algorithm.md#hybrid); loads of other versions are
#: refused.
HYBRID_FORMAT_VERSION = 1
BACKUP_OPTIMIZERS = ("gefen", "adamw")
_VERSION_KEY = "hybrid_format_version"
_DEFAULT_WORKSPACE = 256 << 20


def _err(msg: str) -> ValueError:
    return ValueError(f"GefenMuonHybrid.load_state_dict: {msg}; neither half was changed")


class _RoutedState(MutableMapping[Any, Any]):
    """``hybrid.state``: reads, writes and deletes go to the child that owns the parameter.

    A parameter belongs to the child whose groups list it (looked up again when a wrapper has
    rebound a child's ``params``). A key that is not a tensor (torch.optim keeps such entries
    through ``state_dict``) lives in the first child's state, so the child's checkpoint
    carries it. A tensor no child lists raises a ``KeyError`` that explains the usual cause.
    """

    def __init__(self, children: list[Optimizer]) -> None:
        self._children = children
        # id -> (the tensor, weakly: an id can be reused once a tensor is freed; its owner).
        self._owners: dict[int, tuple[weakref.ref[Tensor], Optimizer]] = {}
        self._refresh()

    def _refresh(self) -> None:
        self._owners = {id(p): (weakref.ref(p), child) for child in self._children
                        for group in child.param_groups for p in group["params"]}

    def _lookup(self, p: Any) -> Optimizer | None:
        if not isinstance(p, Tensor):
            return self._children[0]
        hit = self._owners.get(id(p))
        if hit is None or hit[0]() is not p:
            self._refresh()  # a wrapper rebound a child's params: look again
            hit = self._owners.get(id(p))
        return None if hit is None or hit[0]() is not p else hit[1]

    def _owner(self, p: Any) -> Optimizer:
        owner = self._lookup(p)
        if owner is None:
            raise KeyError(
                "GefenMuonHybrid.state: this tensor is not a parameter the hybrid was built "
                "with. Ownership is fixed at construction; a wrapper such as DeepSpeed ZeRO "
                "replaces parameters with flat partitions, which the Muon family cannot train "
                "(use plain Gefen with ZeRO, or the hybrid with FSDP2/DDP)"
            )
        return owner

    def __getitem__(self, p: Tensor) -> Any:
        return self._owner(p).state[p]

    def __setitem__(self, p: Tensor, value: Any) -> None:
        self._owner(p).state[p] = value

    def __delitem__(self, p: Tensor) -> None:
        del self._owner(p).state[p]

    def __contains__(self, p: object) -> bool:
        owner = self._lookup(p)
        return owner is not None and p in owner.state

    def __iter__(self) -> Iterator[Tensor]:
        for child in self._children:
            yield from child.state

    def __len__(self) -> int:
        return sum(len(child.state) for child in self._children)

    def __repr__(self) -> str:
        return f"<GefenMuonHybrid state of {len(self)} parameters>"


class GefenMuonHybrid(Optimizer):
    r"""GefenMuon on hidden matrices plus a Gefen or AdamW backup, as one optimizer
    (docs/algorithm.md#hybrid).

    Routing (docs/algorithm.md#hybrid, :func:`~gefen_core.routing.split_params_for_muon`): frozen
    parameters are skipped; embedding tables (by identity, so a tied LM head is included), every
    non-2-D or zero-size tensor, and matrices whose name contains ``embed``, ``wte``, ``wpe``,
    ``lm_head``, ``classifier`` or ``score`` go to the backup; the other matrices to Muon.

    Constructor forms (docs/algorithm.md#hybrid):

    1. ``GefenMuonHybrid(muon_named, backup_named, lr=...)`` — two lists of
       ``(name, tensor)`` pairs (either may be empty, not both);
    2. ``GefenMuonHybrid(model, lr=...)`` — an ``nn.Module``, split and checked for
       completeness;
    3. ``GefenMuonHybrid(model.named_parameters(), lr=...)`` — split by names and shapes;
    4. ``GefenMuonHybrid.from_model(model, lr=..., backup_substrings=...)``.

    Args:
        lr (float): learning rate of both halves (keyword, required). With the default
            ``adjust_lr_fn="match_rms_adamw"`` an AdamW learning rate works for both.
        muon_lr, backup_lr (float, optional): per-half overrides of ``lr``.
        backup_optimizer (str): ``"gefen"`` (default) or ``"adamw"`` (``torch.optim.AdamW``).
        weight_decay (float): decay of both halves (default: 0.0); ``muon_weight_decay`` and
            ``backup_weight_decay`` override it per half.
        no_decay_substrings (tuple[str, ...]): backup parameters whose lower-cased name contains
            one of these form a group with weight decay 0 (default: ()).
        backup_1d_period_one, backup_2d_period_one (bool): the backup Gefen's
            ``force_1d_period_one`` / ``force_2d_period_one`` (no-ops with AdamW).
        betas, eps: the backup's (default: (0.9, 0.999), 1e-8); Muon's NS eps is ``muon_eps``
            (default: 1e-7).
        fused (bool, optional): each child's fused implementation (default: None = pick).
        momentum, nesterov, ns_steps, ns_schedule, adjust_lr_fn, sharded_mode, fp8_ns,
        fp8_ns_compile, batched_ns, batched_ns_workspace_bytes, normuon, normuon_beta2,
        normuon_eps, cautious: GefenMuon options; hybrid defaults ``ns_schedule="tuned3"``,
            ``adjust_lr_fn="match_rms_adamw"`` (``None``/``"original"`` warn: a shared
            AdamW-scale lr is then far too small for Muon), ``normuon=True``.
        stochastic_round, deterministic: forwarded to the Gefen children.
        capturable (bool): forwarded to both children (AdamW too).
        backup_substrings (tuple[str, ...], optional): replaces the default routing words
            (forms 2–4 only).
        skip_nonfinite (bool, optional): skip a step whose gradients (either half) hold any
            NaN or Inf element: neither half changes anything, the step is counted in
            ``skipped_steps`` and ``last_step_skipped`` is set; decided once by the hybrid
            (the halves are built without it), incompatible with ``capturable=True``
            (docs/algorithm.md#non-finite-gradients) (default: False).

    Non-finite gradients: without ``skip_nonfinite`` each half applies its own rule (Gefen's
    and GefenMuon's: a non-finite element spreads over its block; AdamW's: it stays in its
    coordinate), except that the step that would learn a codebook is skipped by both halves.

    Raises:
        TypeError: a bare tensor among the parameters; ``backup_substrings`` with two lists;
            an item that is not a ``(name, tensor)`` pair.
        ValueError: a DTensor parameter sharded over ranks (use
            ``gefen_dist.ShardedGefenMuonHybrid``); ``skip_nonfinite`` with ``capturable``;
            no parameters; only zero-size parameters (ZeRO-3 placeholders: the Muon
            family cannot train flat partitions); an unknown ``backup_optimizer``; a split that
            is not a partition of the model's trainable parameters; any child's own errors
            (with torch's texts: Muon's for the Muon options, AdamW's for the backup's).

    Differences from torch.optim (each with its reason in
    docs/internals/torch-optim-deviations.md): the checkpoint nests the children's
    (``{"muon": ..., "backup": ...}``); ``param_groups`` is the children's groups (cannot be
    assigned) and ``add_param_group`` is refused; entries of ``state`` whose key is not a
    parameter live in the first child's state; the children's own differences apply.
    """

    #: The classes of the two Gefen-family children. ``gefen_dist.ShardedGefenMuonHybrid``
    #: swaps in its FSDP2 classes here (same constructor arguments).
    _muon_class: type[GefenMuon] = GefenMuon
    _gefen_class: type[Gefen] = Gefen
    #: The class to name for DTensor parameters sharded over ranks (``None``: handled).
    _sharded_alternative: str | None = "gefen_dist.ShardedGefenMuonHybrid"

    def __init__(
        self,
        params: nn.Module | Iterable[Any],
        backup_named: Iterable[tuple[str, Tensor]] | None = None,
        *,
        lr: float | Tensor,
        muon_lr: float | Tensor | None = None,
        backup_lr: float | Tensor | None = None,
        backup_optimizer: str = "gefen",
        weight_decay: float = 0.0,
        muon_weight_decay: float | None = None,
        backup_weight_decay: float | None = None,
        no_decay_substrings: Iterable[str] = (),
        backup_1d_period_one: bool = False,
        backup_2d_period_one: bool = False,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        muon_eps: float = 1e-7,
        fused: bool | None = None,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = DEFAULT_NS_STEPS,
        ns_schedule: Any = "tuned3",
        adjust_lr_fn: str | None = "match_rms_adamw",
        sharded_mode: str = "exact",
        fp8_ns: bool = False,
        fp8_ns_compile: bool = True,
        batched_ns: bool = False,
        batched_ns_workspace_bytes: int = _DEFAULT_WORKSPACE,
        normuon: bool = True,
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        cautious: bool = False,
        stochastic_round: bool = False,
        deterministic: bool = False,
        capturable: bool = False,
        backup_substrings: Iterable[str] | None = None,
        skip_nonfinite: bool = False,
    ) -> None:
        where = "GefenMuonHybrid"
        _nonfinite.check_skip_option(skip_nonfinite, capturable, where)
        if backup_optimizer not in BACKUP_OPTIMIZERS:
            raise ValueError(
                f"{where}: backup_optimizer must be 'gefen' or 'adamw', got {backup_optimizer!r}"
            )
        muon_named, backup_list = self._split(params, backup_named, backup_substrings, where)
        everything = muon_named + backup_list
        if not everything:
            raise ValueError(f"{where}: got no trainable parameters")
        self._refuse_sharded(everything)
        if all(p.numel() == 0 for _, p in everything):
            raise ValueError(
                f"{where}: every parameter has zero elements. This is the signature of "
                "DeepSpeed ZeRO-3 placeholder parameters (the real weights live in flat "
                "partitions), which the Muon family cannot train; use plain Gefen with ZeRO, "
                "or build the hybrid before wrapping the model with FSDP2/DDP"
            )
        if adjust_lr_fn in (None, "original"):
            warnings.warn(
                f"{where}: adjust_lr_fn={adjust_lr_fn!r} uses Muon's native update scale, about "
                "0.2*sqrt(max(R, C)) times smaller per unit lr than AdamW's; with one shared lr "
                "the Muon half will barely move. Prefer 'match_rms_adamw' or set muon_lr",
                UserWarning, stacklevel=2)
        muon_lr = lr if muon_lr is None else muon_lr
        backup_lr = lr if backup_lr is None else backup_lr
        muon_wd = weight_decay if muon_weight_decay is None else muon_weight_decay
        backup_wd = weight_decay if backup_weight_decay is None else backup_weight_decay
        if isinstance(no_decay_substrings, str):
            raise TypeError(f"{where}: no_decay_substrings must be a tuple of str, e.g. "
                            f"({no_decay_substrings!r},)")
        no_decay = tuple(s.lower() for s in no_decay_substrings)

        muon: GefenMuon | None = None
        if muon_named:
            muon = self._muon_class(
                muon_named, lr=muon_lr, weight_decay=muon_wd, momentum=momentum,
                nesterov=nesterov, eps=muon_eps, ns_steps=ns_steps, ns_schedule=ns_schedule,
                adjust_lr_fn=adjust_lr_fn, fused=fused, sharded_mode=sharded_mode,
                fp8_ns=fp8_ns, fp8_ns_compile=fp8_ns_compile, batched_ns=batched_ns,
                batched_ns_workspace_bytes=batched_ns_workspace_bytes,
                stochastic_round=stochastic_round, deterministic=deterministic,
                normuon=normuon, normuon_beta2=normuon_beta2, normuon_eps=normuon_eps,
                cautious=cautious, capturable=capturable)
        backup: Optimizer | None = None
        if backup_list:
            decayed = [(n, p) for n, p in backup_list if not any(s in n.lower() for s in no_decay)]
            plain = [(n, p) for n, p in backup_list if any(s in n.lower() for s in no_decay)]
            groups: list[dict[str, Any]] = []
            if decayed:
                groups.append({"params": decayed})
            if plain:
                groups.append({"params": plain, "weight_decay": 0.0})
            if backup_optimizer == "gefen":
                backup = self._gefen_class(
                    groups, lr=backup_lr, betas=betas, eps=eps, weight_decay=backup_wd,
                    fused=fused, capturable=capturable, factored_v_2d=False,
                    force_1d_period_one=backup_1d_period_one,
                    force_2d_period_one=backup_2d_period_one,
                    stochastic_round=stochastic_round, deterministic=deterministic)
            else:
                backup = torch.optim.AdamW(
                    groups, lr=backup_lr, betas=betas, eps=eps, weight_decay=backup_wd,
                    fused=fused, capturable=capturable)

        # Not Optimizer.__init__: the groups live in the children; only torch's hook tables
        # and step patching are set up here (the same attributes torch's constructor makes).
        self.defaults = {
            "lr": lr, "muon_lr": muon_lr, "backup_lr": backup_lr,
            "backup_optimizer": backup_optimizer, "weight_decay": weight_decay,
            "betas": betas, "eps": eps, "momentum": momentum, "nesterov": nesterov,
            "ns_schedule": ns_schedule, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
            "normuon": normuon, "capturable": capturable, "fused": fused,
        }
        self._optimizer_step_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True
        self.muon = muon
        self.backup = backup
        self.backup_optimizer = backup_optimizer
        # The halves never skip on their own: the hybrid decides for both (step()).
        self._skip_nonfinite = skip_nonfinite
        #: Steps that ``skip_nonfinite`` skipped since construction.
        self.skipped_steps = 0
        #: Whether the last ``step()`` was skipped by ``skip_nonfinite``.
        self.last_step_skipped = False
        self._state_view = _RoutedState(self._children())

    _HOOK_TABLES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                    "_optimizer_load_state_dict_pre_hooks",
                    "_optimizer_load_state_dict_post_hooks")

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and pickling keep: the two children (each pickled as
        itself) and the hybrid's own settings. Hooks are dropped, as torch.optim drops them;
        the routed ``state`` view is rebuilt on the copy."""
        dropped = (*self._HOOK_TABLES, "_state_view")
        return {k: v for k, v in self.__dict__.items() if k not in dropped}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for attr in self._HOOK_TABLES:
            setattr(self, attr, OrderedDict())
        self._patch_step_function()
        self._state_view = _RoutedState(self._children())

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _split(params: Any, backup_named: Any, backup_substrings: Any,
               where: str) -> tuple[NamedParams, NamedParams]:
        if isinstance(params, Tensor):
            raise TypeError(f"{where}: got a bare tensor; pass a model, named parameters, or "
                            "two lists of (name, tensor) pairs")
        if backup_named is not None:
            if isinstance(params, nn.Module):
                raise TypeError(f"{where}: with a model, do not pass a second list")
            if backup_substrings is not None:
                raise TypeError(
                    f"{where}: backup_substrings only applies when the hybrid routes the "
                    "parameters itself (a model or one named list), not with two explicit lists"
                )
            muon, backup = list(params), list(backup_named)
            validate_split(muon, backup)
            return muon, backup
        if isinstance(params, nn.Module):
            muon, backup = split_params_for_muon(params, backup_substrings=backup_substrings)
            validate_split(muon, backup, params)
            return muon, backup
        items = list(params)
        for i, item in enumerate(items):
            if isinstance(item, Tensor):
                raise TypeError(
                    f"{where}: params[{i}] is a bare tensor; the hybrid routes by name, so pass "
                    "model.named_parameters(), the model itself, or two named lists"
                )
        muon, backup = split_params_for_muon(items, backup_substrings=backup_substrings)
        validate_split(muon, backup)
        return muon, backup

    @classmethod
    def from_model(cls, model: nn.Module, *, backup_substrings: Iterable[str] | None = None,
                   **kwargs: Any) -> GefenMuonHybrid:
        """Build from a model with :func:`split_params_for_muon` (form 4 of
        docs/algorithm.md#hybrid)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"from_model needs an nn.Module, got {type(model).__name__}")
        return cls(model, backup_substrings=backup_substrings, **kwargs)

    def _children(self) -> list[Optimizer]:
        return [c for c in (self.muon, self.backup) if c is not None]

    # ------------------------------------------------------------------ torch.optim surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The Muon child's groups followed by the backup's: the live dicts, so an LR
        scheduler's writes reach the children (a new list on every read)."""
        return [g for child in self._children() for g in child.param_groups]

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        raise TypeError(
            "GefenMuonHybrid.param_groups cannot be assigned: the groups belong to the two "
            "children (hybrid.muon, hybrid.backup). Wrappers that swap in their own groups, "
            "such as DeepSpeed ZeRO's flat partitions, cannot drive the Muon family; use plain "
            "Gefen there, or FSDP2/DDP with the hybrid"
        )

    @property  # type: ignore[override]
    def state(self) -> _RoutedState:
        """Routed view of both children's per-parameter state (reads return live dicts)."""
        return self._state_view

    @state.setter
    def state(self, value: Any) -> None:
        raise TypeError("GefenMuonHybrid.state cannot be assigned; use load_state_dict")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: each parameter's half is fixed at construction (docs/algorithm.md#hybrid).

        Raises:
            NotImplementedError: always; build a new hybrid (or add the group to
                ``hybrid.muon`` / ``hybrid.backup`` directly before training starts).
        """
        raise NotImplementedError(
            "GefenMuonHybrid.add_param_group: parameters are routed to Muon or the backup at "
            "construction; add groups to hybrid.muon or hybrid.backup, or build a new hybrid"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        for child in self._children():
            child.zero_grad(set_to_none=set_to_none)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # One AMP decision for both halves: native protocol (scaler sets found_inf and
        # grad_scale on the hybrid) when any parameter is fp16, whose gradients the scaler
        # refuses to unscale itself; otherwise the scaler unscales and skips step() whole.
        return any(p.dtype == torch.float16 for g in self.param_groups for p in g["params"])

    # ------------------------------------------------------------------ step
    def _backup_preflight(self) -> None:
        backup = self.backup
        if backup is None:
            return
        if isinstance(backup, Gefen):
            backup._capture_guard()
            backup._preflight()
            return
        for group in backup.param_groups:
            names = group.get("param_names")
            if not isinstance(names, list) or len(names) != len(group["params"]):
                names = [None] * len(group["params"])  # absent, or stale after a rebind
            for p, name in zip(group["params"], names, strict=True):
                g = p.grad
                if g is None:
                    continue
                label = repr(name) if name else "a backup parameter"
                if g.is_sparse or g.layout != torch.strided:
                    raise RuntimeError(f"GefenMuonHybrid: {label} has a {g.layout} gradient; "
                                       "AdamW needs dense gradients")
                if g.shape != p.shape:
                    raise RuntimeError(f"GefenMuonHybrid: gradient of {label} has shape "
                                       f"{tuple(g.shape)}, the parameter {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of both halves (docs/algorithm.md#hybrid).

        Order: closure (gradients enabled); the structural checks of both halves (including
        the Muon 2-D check) before anything is mutated; one AMP decision (an overflow skips
        both halves, nothing changes); then the Muon half, then the backup.

        Raises:
            ValueError, RuntimeError: as the children's checks, before any mutation.
        """
        if torch.compiler.is_compiling():
            # docs/algorithm.md#compiled-stepping
            return _compiled_step.traced_hybrid_step(
                self, closure, backup_is_gefen=isinstance(self.backup, Gefen))
        return self._eager_step(closure)

    def _eager_step(self, closure: Callable[[], Any] | None) -> Any:
        if self.muon is not None:
            _compiled_step.sync_global_step(self.muon)  # the backup's own step syncs it
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = None
        if self.muon is not None:
            self.muon._capture_guard()
            entries = self.muon._muon_preflight()
        self._backup_preflight()
        overflow, inv_scale = self._amp_decision()
        if overflow:
            # The scaler found a non-finite gradient: with skip_nonfinite this is such a step.
            if self._skip_nonfinite:
                self.skipped_steps += 1
                self.last_step_skipped = True
            return loss
        if inv_scale is not None:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            _amp.unscale_(grads, inv_scale)
        if self._first_step_has_non_finite():
            if self._skip_nonfinite:
                self.skipped_steps += 1
                self.last_step_skipped = True
                return loss
            warnings.warn(
                "GefenMuonHybrid: non-finite gradients on the step that would learn a codebook; "
                "both halves skip this step (decision O9), so neither moves without the other",
                RuntimeWarning, stacklevel=2)
            return loss
        if self.muon is not None and entries is not None:
            self.muon._apply(entries)
        if self.backup is not None:
            self.backup.step()
        self.last_step_skipped = False
        return loss

    def _amp_decision(self) -> tuple[bool, Any]:
        """``(overflow, inverse scale)`` of the GradScaler protocol, taken once for both halves.
        A distributed subclass agrees ``overflow`` across ranks (one skipping rank must not
        leave the others inside a collective)."""
        return _amp.overflow_and_inverse_scale(self)

    def _first_step_has_non_finite(self) -> bool:
        """Whether this step is skipped for non-finite gradients, for both halves at once:
        with ``skip_nonfinite`` any NaN or Inf gradient element skips it; otherwise only a
        Gefen child that would learn its codebook now makes it skip (O9), so that neither half
        moves without the other (docs/algorithm.md#non-finite-gradients)."""
        learning = [c for c in self._children()
                    if isinstance(c, Gefen) and c._codebook is None]
        if not (learning or self._skip_nonfinite):
            return False
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        return not _nonfinite.all_finite(grads)

    def _refuse_sharded(self, named: list[tuple[str, Tensor]]) -> None:
        """Refuse DTensors sharded over ranks, naming the class that steps them."""
        if self._sharded_alternative is None:
            return
        for name, p in named:
            placements = getattr(p, "placements", None)
            if placements is not None and not all(pl.is_replicate() for pl in placements):
                raise ValueError(
                    f"{type(self).__name__}: parameter {name!r} is a DTensor sharded as "
                    f"{tuple(placements)} (FSDP2 fully_shard or tensor parallel); its halves "
                    "would learn rank-local codebooks and periods. Use "
                    f"{self._sharded_alternative} (same arguments)")

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The nested checkpoint of docs/algorithm.md#hybrid::

            {"muon": <GefenMuon state_dict or None>, "backup": <Gefen/AdamW state_dict or None>,
             "backup_optimizer": "gefen" | "adamw", "hybrid_format_version": 1}
        """
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        sd: dict[str, Any] = {
            "muon": None if self.muon is None else self.muon.state_dict(),
            "backup": None if self.backup is None else self.backup.state_dict(),
            "backup_optimizer": self.backup_optimizer,
            _VERSION_KEY: HYBRID_FORMAT_VERSION,
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a nested checkpoint into both halves, all-or-nothing (docs/algorithm.md#hybrid).

        Both halves are staged and validated (the AdamW half on a shadow optimizer, because
        torch's own load is not fail-before-mutation) before either is committed; the
        children's load post-hooks run after both commits.

        Raises:
            ValueError: a flat (non-hybrid) checkpoint; an unknown version tag; a half present
                in the checkpoint but not in this hybrid or the other way round; a different
                backup type; anything either half rejects. Nothing is changed.
        """
        if not isinstance(state_dict, Mapping):
            raise _err(f"expected a dict, got {type(state_dict).__name__}")
        sd = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, sd)
            if result is not None:
                sd = dict(result)
        if "muon" not in sd and "backup" not in sd:
            raise _err("this is not a GefenMuonHybrid checkpoint (no 'muon' or 'backup' entry; "
                       "a flat torch.optim layout cannot be split between the two halves)")
        version = sd.get(_VERSION_KEY, HYBRID_FORMAT_VERSION)
        if version != HYBRID_FORMAT_VERSION or isinstance(version, bool):
            raise _err(f"{_VERSION_KEY} is {version!r}; this gefen-core reads version "
                       f"{HYBRID_FORMAT_VERSION}")
        for half, live in (("muon", self.muon), ("backup", self.backup)):
            saved = sd.get(half)
            if (saved is None) != (live is None):
                have = "has" if saved is not None else "lacks"
                own = "has none" if live is None else "has one"
                raise _err(f"the checkpoint {have} a {half} half but this hybrid {own}")
        saved_type = sd.get("backup_optimizer", "gefen")
        if saved_type != self.backup_optimizer:
            raise _err(f"the checkpoint's backup optimizer is {saved_type!r}, this hybrid's "
                       f"{self.backup_optimizer!r}")

        try:
            muon_staged = backup_staged = None
            if self.muon is not None:
                muon_staged = self.muon.stage_load(self._child_pre_hooks(self.muon, sd["muon"]))
            if self.backup is not None:
                backup_staged = self._stage_backup(
                    self._child_pre_hooks(self.backup, sd["backup"]))
        except ValueError as exc:
            raise _err(str(exc)) from exc
        # Commit: plain assignments only.
        if self.muon is not None:
            self.muon.commit_load(muon_staged)
        if self.backup is not None:
            self._commit_backup(backup_staged)
        for child in self._children():
            for post_hook in child._optimizer_load_state_dict_post_hooks.values():
                post_hook(child)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    @staticmethod
    def _child_pre_hooks(child: Optimizer, sd: Any) -> Any:
        if not isinstance(sd, Mapping):
            raise ValueError(f"a half's state dict must be a dict, got {type(sd).__name__}")
        sd = dict(sd)
        for pre_hook in child._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(child, sd)
            if result is not None:
                sd = result
        return sd

    def _stage_backup(self, sd: Mapping[str, Any]) -> Any:
        backup = self.backup
        assert backup is not None
        if isinstance(backup, Gefen):
            from .checkpoint import stage_load

            return stage_load(backup, sd)
        return _stage_adamw(backup, sd)

    def _commit_backup(self, staged: Any) -> None:
        backup = self.backup
        assert backup is not None
        if isinstance(backup, Gefen):
            from .checkpoint import commit

            commit(backup, staged)
            return
        state, groups = staged
        backup.state = state
        for live, new in zip(backup.param_groups, groups, strict=True):
            live.clear()
            live.update(new)

    def __repr__(self) -> str:
        parts = [f"{type(self).__name__}("]
        for label, child in (("muon", self.muon), ("backup", self.backup)):
            parts.append(f"  {label}: {type(child).__name__ if child is not None else None}")
        return "\n".join(parts) + "\n)"


def _stage_adamw(live: Optimizer, sd: Mapping[str, Any]) -> tuple[Any, list[Any]]:
    """Load ``sd`` into a shadow AdamW over the same parameters and validate the result.

    torch's ``load_state_dict`` checks group sizes and casts state to the parameters' dtypes,
    but it mutates as it goes and does not check state shapes; the shadow absorbs the first
    and this function checks the second.
    """
    shadow_groups = [dict(g) for g in live.param_groups]
    shadow = torch.optim.AdamW.__new__(torch.optim.AdamW)
    shadow.__dict__.update({k: v for k, v in live.__dict__.items()
                            if k not in ("state", "param_groups")})
    shadow.defaults = dict(live.defaults)
    shadow.state = type(live.state)(dict)
    shadow.param_groups = shadow_groups
    # The shadow has no hooks: the hybrid runs the live child's hooks around the commit.
    for attr in ("_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
        setattr(shadow, attr, OrderedDict())
    try:
        torch.optim.Optimizer.load_state_dict(shadow, copy.copy(dict(sd)))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"the AdamW half was rejected: {exc}") from exc
    # torch keeps a saved tensor that needs no cast as the very same object: the live state
    # would then alias the caller's dict (or another optimizer's live state). Copy those.
    given = {id(v) for entry in (sd.get("state") or {}).values() if isinstance(entry, Mapping)
             for v in entry.values() if isinstance(v, Tensor)}
    for st in shadow.state.values():
        if not isinstance(st, dict):
            continue  # a non-parameter entry, kept as it is (torch.optim's rule)
        for key, v in list(st.items()):
            if isinstance(v, Tensor) and id(v) in given:
                st[key] = v.clone()
    for group in shadow.param_groups:
        lr = group.get("lr")
        if isinstance(lr, Tensor):
            lr_v = float(lr.detach().reshape(()).item())
        elif isinstance(lr, (int, float)) and not isinstance(lr, bool):
            lr_v = float(lr)
        else:
            raise ValueError(f"the AdamW half has an invalid lr {lr!r}")
        if not math.isfinite(lr_v) or lr_v < 0:
            raise ValueError(f"the AdamW half has an invalid lr {lr!r}")
        betas = group.get("betas")
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(0.0 <= float(b) < 1.0 for b in betas)):
            raise ValueError(f"the AdamW half has invalid betas {betas!r}")
        for key in ("eps", "weight_decay"):
            v = group.get(key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) \
                    or v < 0:
                raise ValueError(f"the AdamW half has an invalid {key} {v!r}")
        for p in group["params"]:
            st = shadow.state.get(p)
            if not st:
                continue
            keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
            for key in keys:
                t = st.get(key)
                if not isinstance(t, Tensor) or t.shape != p.shape:
                    got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                    raise ValueError(f"the AdamW half's state[{key!r}] must match the "
                                     f"parameter shape {tuple(p.shape)}, got {got}")
            step = st.get("step")
            step_v = float(step.reshape(()).item()) if isinstance(step, Tensor) \
                and step.numel() == 1 else float("nan")
            if not math.isfinite(step_v) or step_v < 0:
                raise ValueError(f"the AdamW half's step must be a finite count, got {step!r}")
    return shadow.state, shadow.param_groups
