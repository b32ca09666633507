"""What each optimizer supports: training layouts and checkpoint transports.

One small immutable :class:`Capabilities` object per optimizer class says which parameter
layouts it can train (replicated, FSDP2 ``Shard(0)``, ZeRO flat partitions, CPU-resident shards)
and which checkpoint transports it supports (native same-topology, DCP reshard exact/approximate).
Integrations call :func:`check_capabilities` at setup, so an unsupported combination fails before
the first step with a message naming the supported alternative, instead of training with a
silently degraded state or failing at the first checkpoint.

Lookup order for an optimizer (or class): a class attribute ``gefen_capabilities`` found on its
MRO, else the registry filled by :func:`register_capabilities` (the built-in entries cover the
``gefen_core`` classes). Unknown classes have no capabilities and every check fails closed.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "Capabilities",
    "Layout",
    "Transport",
    "UnsupportedCombinationError",
    "capabilities_of",
    "check_capabilities",
    "detect_layouts",
    "instance_capabilities",
    "register_capabilities",
]


class Layout(str, enum.Enum):
    """How parameters are laid out across ranks while training."""

    REPLICATED = "replicated"
    """Plain tensors, identical on every rank (one process, DDP)."""
    FSDP2_SHARD0 = "fsdp2_shard0"
    """DTensor parameters with one ``Shard(0)`` placement on a 1-D mesh (``fully_shard``)."""
    ZERO_FLAT = "zero_flat"
    """DeepSpeed ZeRO flat fp32 partitions (1-D, no logical shape)."""
    CPU_RESIDENT = "cpu_resident"
    """Shards or parameters that live on the CPU while the model computes on an accelerator
    (FSDP2 ``CPUOffloadPolicy``, ZeRO optimizer offload): the optimizer steps them on the CPU."""


class Transport(str, enum.Enum):
    """How optimizer state travels through a checkpoint."""

    NATIVE = "native"
    """``state_dict()``/``load_state_dict()`` or DCP ``get/set_optimizer_state_dict`` on the
    same topology; bit-exact resume."""
    DCP_RESHARD_EXACT = "dcp_reshard_exact"
    """``GefenDCPState`` save on N ranks, load on M ranks with block-aligned shards; bit-exact."""
    DCP_RESHARD_APPROX = "dcp_reshard_approx"
    """``GefenDCPState`` save on N ranks, load on M ranks with re-blocking
    (docs/algorithm.md#resharding error: momentum re-quantized, second moment re-aggregated)."""


class UnsupportedCombinationError(ValueError):
    """The optimizer does not support the requested layout or transport."""


def _freeze_hints(hints: Mapping[Any, str] | Iterable[tuple[Any, str]]) -> Mapping[Any, str]:
    items = hints.items() if isinstance(hints, Mapping) else hints
    return MappingProxyType({k: str(v) for k, v in items})


@dataclass(frozen=True)
class Capabilities:
    """Immutable declaration of what one optimizer class supports.

    Attributes:
        layouts: training layouts the class steps correctly.
        transports: checkpoint transports the class supports.
        hints: for an unsupported layout or transport, the alternative to use (a sentence
            naming a class or option), shown in the error of :func:`check_capabilities`.
    """

    layouts: frozenset[Layout]
    transports: frozenset[Transport]
    hints: Mapping[Layout | Transport, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layouts", frozenset(Layout(x) for x in self.layouts))
        object.__setattr__(self, "transports", frozenset(Transport(x) for x in self.transports))
        object.__setattr__(self, "hints", _freeze_hints(self.hints))

    def supports(self, layout: Layout | str | None = None,
                 transport: Transport | str | None = None) -> bool:
        ok = layout is None or Layout(layout) in self.layouts
        return ok and (transport is None or Transport(transport) in self.transports)

    def __hash__(self) -> int:
        return hash((self.layouts, self.transports, tuple(sorted(self.hints.items()))))


_REGISTRY: dict[type, Capabilities] = {}
_LOCK = threading.Lock()
_BUILTINS_LOADED = False


def register_capabilities(cls: type, capabilities: Capabilities) -> None:
    """Declare ``capabilities`` for ``cls`` (and, through the MRO, its subclasses).

    Raises:
        TypeError: ``cls`` is not a class or ``capabilities`` not a :class:`Capabilities`.
    """
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a class, got {type(cls).__name__}")
    if not isinstance(capabilities, Capabilities):
        raise TypeError(f"capabilities must be a Capabilities, got {type(capabilities).__name__}")
    with _LOCK:
        _REGISTRY[cls] = capabilities


_SHARDED_HINT = (
    "plain Gefen learns a rank-local codebook and period on sharded parameters, so its state "
    "depends on the topology; use gefen_dist.ShardedGefen (same arguments) under fully_shard"
)
_MUON_HINT = (
    "GefenMuon needs whole matrices; flat ZeRO partitions have no matrix shape. Put the "
    "matrices under FSDP2 with gefen_dist.ShardedGefenMuon (sharded_mode='exact' or "
    "'distributed') or use Gefen for ZeRO"
)

GEFEN_CAPABILITIES = Capabilities(
    layouts=frozenset({Layout.REPLICATED, Layout.ZERO_FLAT, Layout.CPU_RESIDENT}),
    transports=frozenset(
        {Transport.NATIVE, Transport.DCP_RESHARD_EXACT, Transport.DCP_RESHARD_APPROX}
    ),
    hints={Layout.FSDP2_SHARD0: _SHARDED_HINT},
)
"""Plain ``gefen_core.Gefen``: its state on plain (replicated) parameters is already the
global state, so ``GefenDCPState`` can save it for a load on any number of ranks."""

SHARDED_GEFEN_CAPABILITIES = Capabilities(
    layouts=frozenset(
        {Layout.REPLICATED, Layout.FSDP2_SHARD0, Layout.CPU_RESIDENT}
    ),
    transports=frozenset(
        {Transport.NATIVE, Transport.DCP_RESHARD_EXACT, Transport.DCP_RESHARD_APPROX}
    ),
    hints={
        Layout.ZERO_FLAT: "ZeRO flat partitions have no global shape to align blocks to; "
        "use plain gefen_core.Gefen as the DeepSpeed client optimizer",
    },
)
"""``gefen_dist.ShardedGefen``."""

GEFEN_MUON_CAPABILITIES = Capabilities(
    layouts=frozenset({Layout.REPLICATED}),
    transports=frozenset({Transport.NATIVE}),
    hints={
        Layout.ZERO_FLAT: _MUON_HINT,
        Layout.FSDP2_SHARD0: "gefen_core.GefenMuon steps plain tensors only; under fully_shard "
        "use gefen_dist.ShardedGefenMuon or gefen_dist.ShardedGefenMuonHybrid (same arguments, "
        "sharded_mode 'exact', 'distributed' or 'approx')",
        Layout.CPU_RESIDENT: "GefenMuon's Newton-Schulz runs on the parameter's device; keep "
        "Muon matrices on the accelerator (offload only the backup optimizer's parameters)",
        Transport.DCP_RESHARD_EXACT: "GefenMuon checkpoints reshard only through the native "
        "consolidated format of sharded_mode='distributed'",
        Transport.DCP_RESHARD_APPROX: "GefenMuon checkpoints reshard only through the native "
        "consolidated format of sharded_mode='distributed'",
    },
)
"""``gefen_core.GefenMuon`` and ``GefenMuonHybrid`` (plain tensors: one process or DDP)."""

SHARDED_GEFEN_MUON_CAPABILITIES = Capabilities(
    layouts=frozenset({Layout.REPLICATED, Layout.FSDP2_SHARD0}),
    transports=frozenset({Transport.NATIVE}),
    hints={
        Layout.ZERO_FLAT: _MUON_HINT,
        Layout.CPU_RESIDENT: "Newton-Schulz runs on the parameter's device; keep Muon matrices "
        "on the accelerator (offload only the backup optimizer's parameters)",
        Transport.DCP_RESHARD_EXACT: "exact and distributed modes write the full (replicated "
        "or consolidated) state, which loads natively on any world size; approx state is "
        "rank-local and loads only on the same topology",
        Transport.DCP_RESHARD_APPROX: "exact and distributed modes write the full (replicated "
        "or consolidated) state, which loads natively on any world size; approx state is "
        "rank-local and loads only on the same topology",
    },
)
"""``gefen_dist.ShardedGefenMuon`` and ``ShardedGefenMuonHybrid`` (FSDP2,
docs/algorithm.md#distributed)."""


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    with _LOCK:
        if _BUILTINS_LOADED:
            return
        import gefen_core

        table = {
            "Gefen": GEFEN_CAPABILITIES,
            "GefenMuon": GEFEN_MUON_CAPABILITIES,
            "GefenMuonHybrid": GEFEN_MUON_CAPABILITIES,
        }
        for name, caps in table.items():
            cls = getattr(gefen_core, name, None)
            if isinstance(cls, type):
                _REGISTRY.setdefault(cls, caps)
        _BUILTINS_LOADED = True


def capabilities_of(optimizer_or_class: Any) -> Capabilities | None:
    """The :class:`Capabilities` declared for an optimizer instance or class, or ``None``.

    A ``gefen_capabilities`` class attribute wins over the registry; both are searched along
    the MRO, so a subclass inherits its base's declaration unless it declares its own.
    """
    cls = optimizer_or_class if isinstance(optimizer_or_class, type) else type(optimizer_or_class)
    _load_builtins()
    for klass in cls.__mro__:
        own = klass.__dict__.get("gefen_capabilities")
        if isinstance(own, Capabilities):
            return own
        if klass in _REGISTRY:
            return _REGISTRY[klass]
    return None


def check_capabilities(
    optimizer: Any,
    *,
    layout: Layout | str | None = None,
    transport: Transport | str | None = None,
) -> Capabilities:
    """Fail before training if ``optimizer`` cannot do ``layout`` and ``transport``.

    Given an optimizer *instance*, the check also covers what the instance actually is:

    * the layouts its parameters are in (:func:`detect_layouts`) are checked as well as
      ``layout``, so ``check_capabilities(opt)`` with no arguments refuses, say, plain
      ``Gefen`` on FSDP2 shards;
    * the instance's options narrow the transports (:func:`instance_capabilities`: a
      ``capturable=True`` group has no ``GefenDCPState`` transport), so a transport passed
      here is one its checkpoint code accepts.

    A class is checked against its declaration alone.

    Args:
        optimizer: optimizer instance or class.
        layout: the training layout the integration is about to use, or ``None``.
        transport: the checkpoint transport it is about to use, or ``None``.

    Returns:
        The :class:`Capabilities` that hold for ``optimizer`` (narrowed for an instance).

    Raises:
        ValueError: ``layout`` or ``transport`` is not a known value, or a parameter is a
            DTensor with a placement no Gefen optimizer supports (:func:`detect_layouts`).
        UnsupportedCombinationError: the class declares no capabilities, or does not support the
            layout (given or detected) or transport; the message lists what it supports and the
            alternative.
    """
    lay = None if layout is None else Layout(layout)
    tra = None if transport is None else Transport(transport)
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    caps = capabilities_of(cls)
    if caps is None:
        raise UnsupportedCombinationError(
            f"{cls.__qualname__} declares no gefen capabilities; register them with "
            "gefen_dist.register_capabilities(cls, Capabilities(...)) or use a gefen_core "
            "optimizer"
        )
    layouts = [] if lay is None else [lay]
    if not isinstance(optimizer, type):
        caps = instance_capabilities(optimizer, caps)
        detected = detect_layouts(_parameters_of(optimizer))
        layouts += sorted(detected - set(layouts), key=lambda x: x.value)
    problems = []
    for one in layouts:
        if one not in caps.layouts:
            supported = sorted(x.value for x in caps.layouts)
            hint = caps.hints.get(one, f"use one of the supported layouts {supported}")
            found = "" if one == lay else " (detected from its parameters)"
            problems.append(
                f"layout {one.value!r}{found} is not supported (supported: {supported}); {hint}"
            )
    if tra is not None and tra not in caps.transports:
        supported = sorted(x.value for x in caps.transports)
        hint = caps.hints.get(tra, f"use one of the supported transports {supported}")
        problems.append(
            f"checkpoint transport {tra.value!r} is not supported (supported: {supported}); "
            f"{hint}"
        )
    if problems:
        raise UnsupportedCombinationError(f"{cls.__qualname__}: " + " | ".join(problems))
    return caps


def _parameters_of(optimizer: Any) -> list[Any]:
    groups = getattr(optimizer, "param_groups", None) or []
    return [p for g in groups for p in g.get("params", ())]


_CAPTURABLE_DCP_HINT = (
    "a capturable=True param group keeps its counters on the device for graph capture, which "
    "GefenDCPState does not save; construct the optimizer with capturable=False for "
    "reshardable checkpoints, or use the native transport"
)


def instance_capabilities(optimizer: Any, caps: Capabilities | None = None) -> Capabilities:
    """The capabilities of one optimizer instance: its class's, narrowed by its options.

    A ``capturable=True`` param group removes the ``GefenDCPState`` transports
    (``dcp_reshard_exact``, ``dcp_reshard_approx``), with a hint naming the fix.

    Raises:
        UnsupportedCombinationError: the class declares no capabilities (and none are given).
    """
    if caps is None:
        caps = capabilities_of(optimizer)
        if caps is None:
            raise UnsupportedCombinationError(
                f"{type(optimizer).__qualname__} declares no gefen capabilities")
    groups = getattr(optimizer, "param_groups", None) or []
    if not any(g.get("capturable") is True for g in groups):
        return caps
    dcp = {Transport.DCP_RESHARD_EXACT, Transport.DCP_RESHARD_APPROX}
    hints = dict(caps.hints)
    for t in dcp & caps.transports:
        hints[t] = _CAPTURABLE_DCP_HINT
    return Capabilities(layouts=caps.layouts, transports=caps.transports - dcp, hints=hints)


def detect_layouts(params: Iterable[Any]) -> frozenset[Layout]:
    """The layouts a set of live parameters is in (what :func:`check_capabilities` should get).

    DTensor parameters with one ``Shard(0)`` placement give :attr:`Layout.FSDP2_SHARD0`; a
    DTensor whose local shard is on the CPU while its mesh is on an accelerator adds
    :attr:`Layout.CPU_RESIDENT`; plain tensors give :attr:`Layout.REPLICATED`. ZeRO flat
    partitions cannot be recognised from the tensors: the DeepSpeed adapter passes that layout
    itself.

    Raises:
        ValueError: a DTensor parameter with another placement (``Replicate``, ``Shard(d>0)``,
            several mesh dimensions), which no Gefen optimizer supports.
    """
    from torch.distributed.tensor import DTensor, Shard

    found: set[Layout] = set()
    for i, p in enumerate(params):
        if isinstance(p, DTensor):
            placements = tuple(p.placements)
            if len(placements) != 1 or placements[0] != Shard(0):
                raise ValueError(
                    f"parameter {i} is a DTensor with placements {placements}; Gefen supports "
                    "exactly one Shard(0) placement on a 1-D mesh (fully_shard's default). "
                    "For HSDP pass the shard sub-mesh to fully_shard"
                )
            found.add(Layout.FSDP2_SHARD0)
            if p.to_local().device.type == "cpu" and p.device_mesh.device_type != "cpu":
                found.add(Layout.CPU_RESIDENT)
        else:
            found.add(Layout.REPLICATED)
    return frozenset(found)
