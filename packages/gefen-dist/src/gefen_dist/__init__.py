"""gefen-dist: Gefen under FSDP2, DDP and torch.distributed.checkpoint.

* :class:`ShardedGefen` — Gefen for FSDP2 ``Shard(0)`` parameters whose codebook and block
  periods are those of the global tensors (all-reduced histogram, globally searched periods).
* :class:`ShardedGefenMuon`, :class:`ShardedGefenMuonHybrid` — GefenMuon (and the hybrid) on
  FSDP2 matrices with ``sharded_mode`` "exact", "distributed" or "approx"
  (docs/algorithm.md#distributed).
* :class:`GefenDCPState`, :class:`GefenSavePlanner`, :class:`GefenStager` — reshardable
  ``torch.distributed.checkpoint`` save/load (N ranks -> M ranks).
* :func:`offload_state_`, :func:`restore_state_`, :func:`move_state_` — optimizer-state
  offload for plain Gefen on replicated CUDA parameters (docs/algorithm.md#distributed).
* :mod:`gefen_dist.capabilities` — what each optimizer supports, checked before training.
* :mod:`gefen_dist.testing` — spawn N gloo ranks for tests, with timeouts.
"""

from ._agree import CollectiveCheckError, agree, agreed, check_grad_presence
from ._version import __version__
from .capabilities import (
    Capabilities,
    Layout,
    Transport,
    UnsupportedCombinationError,
    capabilities_of,
    check_capabilities,
    detect_layouts,
    instance_capabilities,
    register_capabilities,
)
from .dcp import GefenDCPState, GefenSavePlanner, GefenStager
from .offload import move_state_, offload_state_, restore_state_, state_offload_active
from .sharded import ShardedGefen, aligned_period, sharded_period
from .sharded_muon import ShardedGefenMuon, ShardedGefenMuonHybrid

__all__ = [
    "Capabilities",
    "CollectiveCheckError",
    "GefenDCPState",
    "GefenSavePlanner",
    "GefenStager",
    "Layout",
    "ShardedGefen",
    "ShardedGefenMuon",
    "ShardedGefenMuonHybrid",
    "Transport",
    "UnsupportedCombinationError",
    "__version__",
    "agree",
    "agreed",
    "aligned_period",
    "capabilities_of",
    "check_capabilities",
    "check_grad_presence",
    "detect_layouts",
    "instance_capabilities",
    "move_state_",
    "offload_state_",
    "register_capabilities",
    "restore_state_",
    "sharded_period",
    "state_offload_active",
]
