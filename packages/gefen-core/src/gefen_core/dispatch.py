"""The per-tensor implementation choice stated in :data:`gefen_core._docs.DISPATCH_RULE`."""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
from torch import Tensor

Path = Literal["fused", "foreach", "for_loop"]

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    import gefen_kernels

    return bool(gefen_kernels.triton_available())


def fused_blocker(param: Tensor) -> str | None:
    """Why the fused (Triton) path cannot step ``param``, or ``None`` when it can."""
    if param.device.type != "cuda":
        return f"it lives on {param.device.type!r} (the fused kernels run on CUDA only)"
    if param.dtype not in FUSED_DTYPES:
        return f"its dtype is {param.dtype} (the fused kernels take fp32, bf16 or fp16)"
    if not triton_available():
        return "Triton is not available (install a CUDA build of torch, which brings triton)"
    return None


@functools.cache
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # builds without torch.distributed
        return None
    return DTensor


def is_dtensor(t: Tensor) -> bool:
    # Called several times per tensor per step: the class is looked up once, not imported
    # per call (an in-function import costs microseconds on a ~150-tensor step).
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local(t: Tensor) -> Tensor:
    """The tensor Gefen steps: a DTensor's local shard (docs/algorithm.md#state-layout), else the
    tensor itself."""
    if is_dtensor(t):
        shard: Tensor = t.to_local()  # type: ignore[attr-defined]  # DTensor narrows at runtime
        return shard
    return t


def local_numel(t: Tensor) -> int:
    """Elements of the local shard (the state geometry of a DTensor parameter,
    docs/algorithm.md#state-layout)."""
    return local(t).numel()


def is_factored(param: Tensor, group: dict[str, Any], *, sharded: bool = False) -> bool:
    """Factored second moment (docs/algorithm.md#factored-second-moment) for 2-D tensors when
    ``factored_v_2d`` is set and both sides of the (global) shape are at least the group's
    ``min_dim_size_to_factor`` (docs/algorithm.md#factoring-rule; a group without the key factors
    every matrix).

    A DTensor matrix is factored only when ``sharded`` is true: its local rows' column sums
    and ``sum(r)`` are partial, so only an optimizer that reduces them across the shards
    (``Gefen._factored_statistics`` overridden, e.g. ``gefen_dist.ShardedGefen``) may use
    the factored form; otherwise it takes block mode."""
    return bool(group["factored_v_2d"]) and param.ndim == 2 and (
        min(param.shape) >= group.get("min_dim_size_to_factor", 0)) and (
        sharded or not is_dtensor(param))


def choose_path(param: Tensor, group: dict[str, Any], *, deterministic: bool,
                sharded_factored: bool = False) -> Path:
    """The implementation that steps ``param`` (see ``DISPATCH_RULE``); ``sharded_factored``
    as ``is_factored``'s ``sharded``."""
    fused = group["fused"]
    if fused is not False and fused_blocker(param) is None:
        if not (deterministic and is_factored(param, group, sharded=sharded_factored)):
            return "fused"
    if group["foreach"] is False:
        return "for_loop"
    if group["foreach"] is True or param.device.type == "cuda":
        return "foreach"
    return "for_loop"


def split_by_device(lists: dict[str, list[Any]]) -> list[dict[str, list[Any]]]:
    """A step's per-path tensor lists split by the parameters' device (one sub-dict each)."""
    params = lists["params"]
    if params and all(p.device == params[0].device for p in params):
        return [lists]  # the usual case: no per-element regrouping
    devices: dict[torch.device, dict[str, list[Any]]] = {}
    n = len(lists["params"])
    for i in range(n):
        dev = lists["params"][i].device
        out = devices.setdefault(dev, {k: [] for k in lists})
        for k, v in lists.items():
            if v:
                out[k].append(v[i])
    return list(devices.values())
