"""Stochastic-rounding seeds, one per tensor per step (O7, docs/algorithm.md#stochastic-rounding).

The seed of a tensor at step ``T`` is ``((T * MIX) mod 2**64) xor salt`` as a signed 64-bit
int, with ``salt`` the first 8 bytes of BLAKE2b of the parameter's name. Capturable steps mix
them on the device from the device step count (:func:`fill_device_seeds`).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import torch

__all__ = ["fill_device_seeds", "mix_seed", "name_salt"]

# Odd 64-bit constant multiplying the global step before the per-tensor salt is mixed in (O7).
_SEED_MIX = 0xD1B54A32D192ED03
_MASK64 = (1 << 64) - 1
# Salts tables kept per optimizer for capturable steps (fill_device_seeds): a training
# loop steps one or a few lists of tensors; where the list changes every step, the rest mix
# their seeds per tensor.
_SALT_TABLES = 8


def _to_signed64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


@functools.lru_cache(maxsize=65536)
def name_salt(name: str) -> int:
    """Stable per-tensor salt (O7): the first 8 bytes of BLAKE2b of the parameter name."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


def mix_seed(global_step: int, salt: int) -> int:
    """The stochastic-rounding seed of one tensor in one step: ``(T * MIX) xor salt`` as a
    signed 64-bit int (two's complement), the form the kernels take (contracts.md)."""
    return _to_signed64(((global_step * _SEED_MIX) & _MASK64) ^ salt)


def fill_device_seeds(opt: Any, dev: torch.device, slots: list[tuple[list[Any], int, int]]) -> None:
    """The capturable seeds ``(T * MIX) xor salt`` of one device's tensors (O7,
    docs/algorithm.md#stochastic-rounding) from its device step count: one launch for all of
    them (a graph replays every launch of the step, so ~2 per tensor would cost more than
    GPT-2's kernels), the same values as one tensor at a time. Each slot ``(list, index,
    salt)`` gets a ``[1]`` view. The salts tables live in ``opt._salt_tensors``."""
    t_dev = opt._device_step(dev)
    salts = tuple(salt for _, _, salt in slots)
    key = (dev, salts)
    table = opt._salt_tensors.get(key)
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if table is None and not capturing and len(opt._salt_tensors) < _SALT_TABLES:
        # A host copy cannot be captured: a graph captured without an eager step over the
        # same tensors first (torch's recipe warms up), or past the table limit, mixes the
        # seeds one by one below (the same values, two launches per tensor).
        host = torch.tensor([_to_signed64(s) for s in salts], dtype=torch.int64)
        table = torch.empty_like(host, device=dev)
        pinned = dev.type == "cuda"
        table.copy_(host.pin_memory() if pinned else host, non_blocking=pinned)
        opt._salt_tensors[key] = table
    if table is not None:
        seeds = torch.bitwise_xor(t_dev * _to_signed64(_SEED_MIX), table)
        views = [seeds[i : i + 1] for i in range(len(slots))]
    else:
        views = [
            torch.bitwise_xor(t_dev * _to_signed64(_SEED_MIX), _to_signed64(salt)).reshape(1)
            for salt in salts
        ]
    for (seed_list, at, _), view in zip(slots, views):
        seed_list[at] = view
