"""GefenMuon's options: their checks and the learning-rate adjustment
(docs/algorithm.md#gefenmuon). Re-exported by :mod:`gefen_core.muon`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import _params
from .newton_schulz import resolve_ns_schedule

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
SHARDED_MODES = ("exact", "distributed", "approx")


def adjusted_lr_ratio(adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """The factor ``α(R, C)`` multiplying the lr of a ``R × C`` matrix's update
    (docs/algorithm.md#gefenmuon).

    ``None``/``"original"``: ``sqrt(max(1, R / C))`` (Muon's native scale, lr in units of
    spectral norm per update); ``"match_rms_adamw"``: ``0.2 · sqrt(max(R, C))``, which makes the
    update RMS about ``0.2 · lr``, like AdamW's, so AdamW learning rates carry over.
    ``shape`` is the *global* shape (a DTensor's ``.shape``).
    """
    rows, cols = int(shape[0]), int(shape[1])
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols)) if cols > 0 else 1.0
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_muon_options(group: Mapping[str, Any], where: str) -> None:
    """Validate the Muon keys of one complete group (docs/algorithm.md#gefenmuon).
    ``ns_coefficients`` must already be a resolved list of triples whose length is ``ns_steps``."""
    m = group["momentum"]
    if not _is_real(m):
        raise TypeError(f"{where}: momentum must be a float, got {type(m).__name__}")
    if m < 0.0:
        raise ValueError(_params.torch_error(f"momentum should be >= 0 but is: {m}", where,
                                             "momentum must be in [0, 1)"))
    if not m < 1.0:
        raise ValueError(f"{where}: momentum must be a float in [0, 1), got {m!r}")
    for key in ("nesterov", "fp8_ns", "fp8_ns_compile", "batched_ns", "normuon", "cautious"):
        if not isinstance(group[key], bool):
            raise TypeError(f"{where}: {key} must be a bool, got {group[key]!r}")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(_params.torch_error(
            f"Adjust learning rate function {group['adjust_lr_fn']} is not supported", where,
            "adjust_lr_fn must be None, 'original' or 'match_rms_adamw'"))
    if group["sharded_mode"] not in SHARDED_MODES:
        raise ValueError(
            f"{where}: sharded_mode must be one of {SHARDED_MODES}, got {group['sharded_mode']!r}"
        )
    ws = group["batched_ns_workspace_bytes"]
    if isinstance(ws, bool) or not isinstance(ws, int) or ws <= 0:
        raise ValueError(
            f"{where}: batched_ns_workspace_bytes must be a positive int (bytes), got {ws!r}"
        )
    b2 = group["normuon_beta2"]
    if not _is_real(b2) or not 0.0 <= b2 < 1.0:
        raise ValueError(f"{where}: normuon_beta2 must be a float in [0, 1), got {b2!r}")
    ne = group["normuon_eps"]
    if not _is_real(ne) or not math.isfinite(ne) or ne <= 0.0:
        raise ValueError(f"{where}: normuon_eps must be finite and > 0, got {ne!r}")
    sched = resolve_ns_schedule(group["ns_coefficients"])
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps != len(sched):
        raise ValueError(
            f"{where}: ns_steps ({steps!r}) must equal the number of Newton–Schulz iterations "
            f"in ns_coefficients ({len(sched)})"
        )


def _not_a_matrix_at_construction(where: str, index: int, name: str | None,
                                  shape: tuple[int, ...]) -> ValueError:
    label = f"params[{index}]" + (f" ({name!r})" if name else "")
    return ValueError(_params.torch_error(
        "Muon only supports 2D parameters whereas we found a parameter with size: "
        f"{torch.Size(shape)}", where,
        f"GefenMuon trains 2-D weight matrices only, but {label} has shape {shape}. "
        "Give embeddings, heads, norms, biases and convolution kernels to Gefen or AdamW, "
        "or use GefenMuonHybrid(model, lr=...), which routes them automatically"))
